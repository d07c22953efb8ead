"""What goes through the job's store, and how a record proves it came from someone holding the job's token.

torch's ``TCPStore`` has no authentication: any client that reaches its port can set any key. So
every record is signed (HMAC-SHA256 with the job's token) and readers drop what does not verify:

- a **request** (``JoinRequest``, ``LeaveRequest``) is signed by the process that sends it; the store
  process (``server.py``) admits it only if the signature holds (the sender has the token) and, for a
  join, the model matches the job's (``job_fingerprint``: model spec, recipe, optimizer settings,
  package version);
- a **membership** record (``Membership``: generation, member ids in rank order, the step it takes
  effect at) is written by the store process alone and signed by it; trainers act on nothing else.

A forged or unsigned record is refused and logged: it consumes no rank and bumps no generation.

Example::

    signer = Signer(b"job-token")
    blob = signer.sign(JoinRequest(member="host:1234:ab12", fingerprint="...").to_dict())
    signer.verify(blob)   # the dict, or None when the signature does not hold
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_dynatrain.vps.errors import DynaTrainError


class AdmissionError(DynaTrainError):
    """The job's store refused this process (wrong token, another model, or the job is gone)."""


class Signer:
    """Signs and checks records with the job's token (HMAC-SHA256 over the record's canonical JSON)."""

    def __init__(self, token: bytes | str) -> None:
        self._key = token.encode() if isinstance(token, str) else token
        if not self._key:
            raise AdmissionError("the job's token is empty", hint="set DYNATRAIN_TOKEN (any secret string) for "
                                 "every process of the job and for the store process")

    def _mac(self, body: bytes) -> str:
        return hmac.new(self._key, body, hashlib.sha256).hexdigest()

    def sign(self, payload: dict[str, Any]) -> bytes:
        body = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        return json.dumps({"body": body.decode(), "mac": self._mac(body)}).encode()

    def verify(self, blob: bytes) -> dict[str, Any] | None:
        """The signed payload, or ``None`` when ``blob`` is not a record signed with this token."""
        try:
            outer = json.loads(blob)
            body = outer["body"].encode()
            if not hmac.compare_digest(self._mac(body), str(outer["mac"])):
                return None
            return json.loads(body)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """A process asks to become a member: its id, the fingerprint of what it would train, and the
    launch it came with: the processes one launcher started together (``launch_id``, their number
    ``launch_size`` and this one's rank among them) form the first world, or join together."""

    member: str
    fingerprint: str
    launch_rank: int = 0
    launch_size: int = 1
    launch_id: str = ""
    ends_with_launch: bool = False
    """Its launcher ends every process of the launch once one ended (torchrun's agent): the store
    records them failed together."""
    world_sizes: tuple[int, ...] | None = None
    """The world sizes its layout policy has a layout for (``None``: any). The first world's say
    what the job can run at: the store admits a join only into a world of one of them."""
    kind: str = "join"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class LeaveRequest:
    """A member announces it leaves (a preemption notice): it hands its state off first."""

    member: str
    step: int = -1
    """The optimizer step after which its process asked (at that boundary); -1: not known."""
    kind: str = "leave"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Membership:
    """The world of one generation: member ids in rank order, from optimizer step ``effective_step``
    on (the change runs at that step's boundary). ``joined``/``left``: what changed from the last
    generation; ``failed``: members that stopped without leaving (``members`` are the survivors, who
    recover into this world; when none survived, ``members`` are the last world's and the job is
    over: ``survived``); ``dropped``: below."""

    generation: int
    members: tuple[str, ...]
    effective_step: int
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    failed: tuple[str, ...] = field(default=())
    dropped: tuple[str, ...] = ()
    """Joiners of the last generation that stopped before it took effect: that change is cancelled
    (this generation has the members of the world that runs)."""

    @property
    def survived(self) -> bool:
        """A failure record whose members are the survivors (they go on in this world)."""
        return bool(self.failed) and not set(self.failed) & set(self.members)

    def rank_of(self, member: str) -> int | None:
        return self.members.index(member) if member in self.members else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Membership":
        return cls(generation=int(d["generation"]), members=tuple(d["members"]), effective_step=int(d["effective_step"]),
                   joined=tuple(d.get("joined", ())), left=tuple(d.get("left", ())), failed=tuple(d.get("failed", ())),
                   dropped=tuple(d.get("dropped", ())))


def job_fingerprint(*parts: Any) -> str:
    """A hash of what a process would train (model spec, recipe, optimizer settings, package
    version, ...): a joiner must present the job's (``repr`` of each part, in order, without the
    memory addresses some reprs hold: an object's, a scheduler's, a function's)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(re.sub(r" at 0x[0-9a-fA-F]+", "", repr(part)).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


__all__ = ["AdmissionError", "JoinRequest", "LeaveRequest", "Membership", "Signer", "job_fingerprint"]
