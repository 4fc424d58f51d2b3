// convoy's small SVG line charts. Each series differs by dash pattern and marker shape as well as by colour,
// and is named in a legend and at its line's end, so a chart reads the same in greyscale.
"use strict";

const ConvoyChart = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const COLOURS = ["#1f5fa8", "#c0392b", "#2d8a4e", "#8e44ad", "#b9770e", "#117a8b", "#6d4c41", "#444444"];
  const DASHES = ["", "6 3", "2 3", "8 3 2 3", "10 4", "1 2", "4 2 1 2 1 2", "12 2 2 2"];
  const MARKERS = ["circle", "square", "triangle", "diamond", "cross", "plus", "down", "bar"];
  const MARKS_PER_SERIES = 8;

  function el(name, attrs, parent) {
    const node = document.createElementNS(NS, name);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    if (parent) parent.appendChild(node);
    return node;
  }

  function niceStep(span, count) {
    const raw = span / Math.max(1, count);
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const unit = raw / power;
    return (unit >= 5 ? 10 : unit >= 2 ? 5 : unit >= 1 ? 2 : 1) * power;
  }

  function ticks(low, high, count) {
    if (!(high > low)) return [low];
    const step = niceStep(high - low, count);
    const out = [];
    for (let value = Math.ceil(low / step) * step; value <= high + step * 1e-9; value += step) out.push(value);
    return out;
  }

  function label(value) {
    const size = Math.abs(value);
    if (size >= 1e6) return (value / 1e6).toPrecision(3) + "M";
    if (size >= 1e4) return (value / 1e3).toPrecision(3) + "k";
    if (size !== 0 && size < 1e-2) return value.toExponential(1);
    return String(Number(value.toPrecision(4)));
  }

  function marker(shape, x, y, colour, parent) {
    const r = 3.5;
    const common = {fill: colour, stroke: colour, "stroke-width": 1.2, class: "marker"};
    const poly = (points) => el("polygon", {...common, points: points.map((p) => p.join(",")).join(" ")}, parent);
    const line = (x1, y1, x2, y2) => el("line", {...common, x1, y1, x2, y2, "stroke-width": 2}, parent);
    switch (shape) {
      case "circle": return el("circle", {...common, cx: x, cy: y, r}, parent);
      case "square": return el("rect", {...common, x: x - r, y: y - r, width: 2 * r, height: 2 * r}, parent);
      case "triangle": return poly([[x, y - r - 1], [x - r, y + r], [x + r, y + r]]);
      case "down": return poly([[x, y + r + 1], [x - r, y - r], [x + r, y - r]]);
      case "diamond": return poly([[x, y - r - 1], [x + r + 1, y], [x, y + r + 1], [x - r - 1, y]]);
      case "cross": line(x - r, y - r, x + r, y + r); return line(x - r, y + r, x + r, y - r);
      case "plus": line(x - r, y, x + r, y); return line(x, y - r, x, y + r);
      default: return el("rect", {...common, x: x - 1.5, y: y - r, width: 3, height: 2 * r}, parent);
    }
  }

  function style(index) {
    return {colour: COLOURS[index % COLOURS.length], dash: DASHES[index % DASHES.length],
            marker: MARKERS[index % MARKERS.length]};
  }

  // series: [{name, x: [...], y: [...]}] (a null y is a gap). Draws into container, replacing what was there.
  function line(container, options) {
    const width = options.width || 640, height = options.height || 260;
    const pad = {left: 58, right: 92, top: 26, bottom: 40};
    const series = options.series.filter((s) => s.x.length);
    const svg = el("svg", {viewBox: `0 0 ${width} ${height}`, role: "img", class: "chart",
                           "aria-label": options.title});
    const xs = [], ys = [];
    let points = 0;
    for (const s of series) {
      for (let i = 0; i < s.x.length; i++) {
        if (s.y[i] === null || s.y[i] === undefined) continue;
        xs.push(s.x[i]); ys.push(s.y[i]); points++;
      }
    }
    svg.setAttribute("data-points", String(points));
    el("text", {x: pad.left, y: 16, class: "chart-title"}, svg).textContent = options.title;
    if (!points) {
      el("text", {x: width / 2, y: height / 2, "text-anchor": "middle", class: "chart-empty"}, svg).textContent =
        "no points yet";
      container.replaceChildren(svg);
      return svg;
    }
    let xMin = xs[0], xMax = xMin, yMin = Infinity, yMax = -Infinity;
    for (const v of xs) { if (v < xMin) xMin = v; if (v > xMax) xMax = v; }
    for (const v of ys) { if (v < yMin) yMin = v; if (v > yMax) yMax = v; }
    if (xMax === xMin) xMax = xMin + 1;
    if (yMax === yMin) { yMax += Math.abs(yMax) * 0.1 || 1; yMin -= Math.abs(yMin) * 0.1 || 1; }
    const spread = (yMax - yMin) * 0.05;
    yMin -= spread; yMax += spread;
    const sx = (v) => pad.left + (v - xMin) / (xMax - xMin) * (width - pad.left - pad.right);
    const sy = (v) => height - pad.bottom - (v - yMin) / (yMax - yMin) * (height - pad.top - pad.bottom);
    const axes = el("g", {class: "axes"}, svg);
    for (const t of ticks(yMin, yMax, 5)) {
      el("line", {x1: pad.left, x2: width - pad.right, y1: sy(t), y2: sy(t), class: "grid"}, axes);
      el("text", {x: pad.left - 6, y: sy(t) + 4, "text-anchor": "end"}, axes).textContent = label(t);
    }
    for (const t of ticks(xMin, xMax, 6)) {
      el("line", {x1: sx(t), x2: sx(t), y1: height - pad.bottom, y2: height - pad.bottom + 4, class: "tick"}, axes);
      el("text", {x: sx(t), y: height - pad.bottom + 16, "text-anchor": "middle"}, axes).textContent = label(t);
    }
    el("line", {x1: pad.left, x2: width - pad.right, y1: height - pad.bottom, y2: height - pad.bottom,
                class: "axis"}, axes);
    el("line", {x1: pad.left, x2: pad.left, y1: pad.top, y2: height - pad.bottom, class: "axis"}, axes);
    el("text", {x: (pad.left + width - pad.right) / 2, y: height - 6, "text-anchor": "middle",
                class: "axis-label"}, axes).textContent = options.xLabel || "";
    el("text", {x: 12, y: height / 2, transform: `rotate(-90 12 ${height / 2})`, "text-anchor": "middle",
                class: "axis-label"}, axes).textContent = options.yLabel || "";
    series.forEach((s, index) => {
      const look = style(s.styleIndex === undefined ? index : s.styleIndex);
      const group = el("g", {class: "series", "data-series": s.name, "data-points": String(s.x.length)}, svg);
      let d = "", pen = "M", last = null;
      for (let i = 0; i < s.x.length; i++) {
        if (s.y[i] === null || s.y[i] === undefined) { pen = "M"; continue; }
        d += `${pen}${sx(s.x[i]).toFixed(1)},${sy(s.y[i]).toFixed(1)}`;
        pen = "L"; last = i;
      }
      el("path", {d, fill: "none", stroke: look.colour, "stroke-width": 1.6, "stroke-dasharray": look.dash}, group);
      const every = Math.max(1, Math.floor(s.x.length / MARKS_PER_SERIES));
      for (let i = index % every; i < s.x.length; i += every) {
        if (s.y[i] !== null && s.y[i] !== undefined) marker(look.marker, sx(s.x[i]), sy(s.y[i]), look.colour, group);
      }
      if (last !== null) {
        el("text", {x: sx(s.x[last]) + 6, y: sy(s.y[last]) + 4, class: "end-label", fill: look.colour}, group)
          .textContent = s.name;
      }
    });
    legend(svg, series, width - pad.right + 10, pad.top);
    container.replaceChildren(svg);
    return svg;
  }

  function legend(svg, series, x, y) {
    const group = el("g", {class: "legend"}, svg);
    series.forEach((s, index) => {
      const look = style(s.styleIndex === undefined ? index : s.styleIndex);
      const row = y + index * 16;
      el("line", {x1: x, x2: x + 22, y1: row, y2: row, stroke: look.colour, "stroke-width": 1.6,
                  "stroke-dasharray": look.dash}, group);
      marker(look.marker, x + 11, row, look.colour, group);
      el("text", {x: x + 27, y: row + 4}, group).textContent = s.name;
    });
  }

  // bars: [{label, start, end, note}] on a time axis; a bar still open ends at `now` and is drawn hatched.
  function timeline(container, bars, now) {
    const width = 760, rowHeight = 26, pad = {left: 70, right: 16, top: 10, bottom: 30};
    const height = pad.top + pad.bottom + rowHeight * Math.max(1, bars.length);
    const svg = el("svg", {viewBox: `0 0 ${width} ${height}`, role: "img", class: "chart timeline",
                           "aria-label": "rounds over time"});
    if (!bars.length) { container.replaceChildren(svg); return svg; }
    const t0 = Math.min(...bars.map((b) => b.start)), t1 = Math.max(now, ...bars.map((b) => b.end || now));
    const sx = (t) => pad.left + (t - t0) / Math.max(1e-9, t1 - t0) * (width - pad.left - pad.right);
    bars.forEach((bar, index) => {
      const y = pad.top + index * rowHeight;
      const end = bar.end || now;
      el("text", {x: pad.left - 8, y: y + 16, "text-anchor": "end"}, svg).textContent = bar.label;
      el("rect", {x: sx(bar.start), y: y + 4, width: Math.max(2, sx(end) - sx(bar.start)), height: rowHeight - 8,
                  class: bar.end ? "bar" : "bar open", "data-round": bar.label}, svg);
      el("text", {x: sx(bar.start) + 4, y: y + 17, class: "bar-note"}, svg).textContent = bar.note;
    });
    for (const t of ticks(0, t1 - t0, 6)) {
      el("text", {x: sx(t0 + t), y: height - 10, "text-anchor": "middle"}, svg).textContent = `${label(t)} s`;
    }
    container.replaceChildren(svg);
    return svg;
  }

  return {line, timeline, style};
})();
