"""Pipeline parallelism: schedules as data (schedule.py), checked (validate.py), timed on paper
(simulate.py), executed on torch.distributed (runtime.py), bubbles filled by tensor parallelism
(planned in fill.py, executed by ``parallel/tensor/blocks.py``), activation memory measured (memory.py), and
drawn (timeline.py)."""
