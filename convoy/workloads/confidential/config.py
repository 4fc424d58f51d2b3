"""The enclave's configuration: part of its measurement, so a provider knows exactly what will train on its data."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from convoy.errors import ConfigError

TASKS = ("linear", "logistic", "mlp")
MODES = ("data", "model")
BACKENDS = ("simulated", "hardware")


@dataclass(frozen=True)
class Party:
    """A provider the enclave accepts, named and pinned by its Ed25519 identity key (hex of the raw 32 bytes)."""

    name: str
    identity_key: str


@dataclass(frozen=True)
class EnclaveConfig:
    """What the enclave trains, for whom, and how; ``canonical()`` is hashed into the measurement."""

    task: str = "logistic"
    """``linear`` (least squares), ``logistic`` (Newton/IRLS) or ``mlp`` (a small torch MLP, binary labels)."""
    mode: str = "data"
    """``data``: providers send encrypted rows, the enclave trains on them pooled; ``model``: providers send
    encrypted local models and the enclave averages them weighted by rows."""
    parties: tuple[Party, ...] = ()
    """The providers, in the order their rows are pooled; nobody else can open a session."""
    features: int = 8
    """Columns of X every provider must send."""
    rounds: int = 1
    """Training rounds (data mode: 1; model mode: averaging rounds, providers train locally in between)."""
    hidden: int = 32
    """MLP hidden width."""
    epochs: int = 60
    """MLP epochs per training (per round, in model mode)."""
    learning_rate: float = 0.01
    """MLP Adam learning rate."""
    batch_size: int = 256
    """MLP mini-batch size."""
    l2: float = 1e-6
    """Ridge penalty of the logistic Newton solver (keeps separable data finite)."""
    seed: int = 0
    """MLP initialisation and shuffling seed."""
    backend: str = "simulated"
    """``simulated`` (a local Ed25519 key stands in for the hardware root of trust) or ``hardware``."""
    plaintext_baseline: bool = False
    """Benchmark peer only: no attestation, no encryption. Measured, so no provider expecting the secure
    configuration accepts such an enclave."""
    labels: dict[str, str] = field(default_factory=dict)
    """Free-form labels (e.g. ``{"run": "demo"}``), measured too; the enclave does not interpret them."""

    def validate(self) -> EnclaveConfig:
        if self.task not in TASKS:
            raise ConfigError(f"task {self.task!r} is unknown; choose from {', '.join(TASKS)}")
        if self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r} is unknown; choose from {', '.join(MODES)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is unknown; choose from {', '.join(BACKENDS)}")
        names = [party.name for party in self.parties]
        if len(names) < 1 or len(set(names)) != len(names) or not all(names):
            raise ConfigError(f"parties must be one or more distinct, non-empty names (got {names})")
        for party in self.parties:
            if len(party.identity_key) != 64 or any(c not in "0123456789abcdef" for c in party.identity_key):
                raise ConfigError(f"party {party.name!r}: identity_key must be 64 lowercase hex digits (an Ed25519 "
                                  "public key)")
        for name in ("features", "rounds", "hidden", "epochs", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1 (got {value!r})")
        if self.mode == "data" and self.rounds != 1:
            raise ConfigError(f"data mode trains once on the pooled rows: rounds must be 1 (got {self.rounds})")
        if not self.learning_rate > 0 or not self.l2 >= 0:
            raise ConfigError(f"learning_rate must be > 0 and l2 >= 0 (got {self.learning_rate}, {self.l2})")
        return self

    def canonical(self) -> bytes:
        """Stable bytes of every field (sorted keys, no spaces): what the measurement hashes."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> EnclaveConfig:
        """The inverse of ``to_json``; raises ConfigError on a field it does not know."""
        try:
            fields = dict(data)
            fields["parties"] = tuple(Party(**party) for party in fields.get("parties", ()))
            return cls(**fields).validate()
        except TypeError as exc:
            raise ConfigError(f"enclave configuration is malformed: {exc}") from exc

    def party_names(self) -> list[str]:
        return [party.name for party in self.parties]
