"""Following `crl.policy`: which policy versions exist, for workers that play a policy (rollout, extractor).

    follower = PolicyFollower(context.follow, "actor").start()   # a worker that declares `follows = (POLICY, ...)`
    newest = follower.newest()                 # PolicyPublished | None
    policy = load_published(newest, "transformers", device="cpu")   # sha256 checked before use

Every instance reads the whole (one-partition) topic from offset 0 through a follower of the runtime
(`pipeline.runtime.log`): a consumer group would spread the one partition over the instances, and each of them needs
every version. Loading
verifies the checkpoint's manifest sha256 against the event and every file it reads against the manifest
(`load_checkpoint`, each file hashed in the pass that reads it); a mismatch raises `CheckpointError` and the worker
keeps the version it has. A new version goes into the model the worker holds, in place, whenever it can
(`load_published`).
"""

from __future__ import annotations

import logging
import threading
import time

from pipeline.errors import CheckpointError, ConfigError, InvalidArgumentError, InvalidStateError
from pipeline.models.base import PolicyModel
from pipeline.models.checkpoints import checkpoint_path, load_for_generation, manifest_sha256
from pipeline.models.lora import ADAPTER_FILE
from pipeline.models.transformers_backend import TransformersPolicy
from pipeline.runtime.log import Follow, FollowedView, Follower
from pipeline.runtime.transport import Record
from schemas.base import Role
from schemas.codec import EventDecodeError, decode
from schemas.topics import POLICY
from schemas.training import PolicyPublished

log = logging.getLogger(__name__)


def load_published(event: PolicyPublished, backend: str, device: str = "cpu", *,
                   micro_batch_size: int = 8, seed: int = 0, current: PolicyModel | None = None,
                   precision: str = "float32") -> PolicyModel:
    """The policy of `event`, after its checkpoint's sha256 checks out, to generate at `precision` (transformers:
    the generation copy `TransformersPolicy.for_generation` makes: bfloat16, or float32 with packed layers, a LoRA
    adapter merged in; or the float32 policy itself where no copy is made).

    What `current` (the policy the worker holds) already has is reused, in place:
    - a LoRA version on the base `current` holds (or the float32 policy a generation copy `current` was made from)
      gets its adapter set, the base is not loaded again, and the merged weights are written into the copy;
    - a full version of the same architecture (the same config and tokenizer files) is copied into `current`'s
      parameters, and into its generation copy's, once the new weights' hash has checked out; no model is built.
    A refused version (`CheckpointError`) leaves `current` as it was. The vllm backend hands a full version to the
    running engine when its architecture is the one served (`VllmPolicy.load_version`)."""
    path = checkpoint_path(event.checkpoint_uri)
    if backend == "transformers":
        return load_for_generation(path, event.sha256, device,
                                   current=current if isinstance(current, TransformersPolicy) else None,
                                   precision=precision, micro_batch_size=micro_batch_size)
    if backend == "vllm":
        from pipeline.models.vllm_backend import VllmPolicy

        if (actual := manifest_sha256(path)) != event.sha256:
            raise CheckpointError(f"{path}: manifest sha256 {actual}, the event says {event.sha256}")
        if (path / ADAPTER_FILE).exists():
            raise ConfigError(f"{path} is a LoRA adapter version; the vllm backend serves full checkpoints only "
                              "(set the role's generation.backend to transformers, or model.lora.rank to 0)")
        if isinstance(current, VllmPolicy) and current.load_version(path, event.sha256):
            return current
        return VllmPolicy(str(path), seed=seed)
    raise InvalidArgumentError(f"unknown backend {backend!r}; valid values: transformers, vllm")


class PolicyFollower(FollowedView):
    """Tails `crl.policy` and keeps the newest `PolicyPublished` of one role."""

    def __init__(self, follow: Follow, role: Role) -> None:
        self.role = role
        self._newest: PolicyPublished | None = None
        self._versions: dict[int, PolicyPublished] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.refused: set[int] = set()
        """Versions whose checkpoint failed its sha256 check."""
        self.follower: Follower = follow([POLICY], self._on_record, name=f"policy-{role}")

    def newest(self) -> PolicyPublished | None:
        if self.failure is not None:
            raise InvalidStateError(f"the policy follower stopped: {self.failure}") from self.failure
        with self._lock:
            return self._newest

    def newer_than(self, version: int) -> PolicyPublished | None:
        """The newest event if its version is above `version` and was not refused."""
        newest = self.newest()
        if newest is None or newest.version <= version or newest.version in self.refused:
            return None
        return newest

    def published(self, version: int) -> PolicyPublished | None:
        """The first `PolicyPublished` of `version` seen (None: not yet; deterministic mode plays exact versions)."""
        if self.failure is not None:
            raise InvalidStateError(f"the policy follower stopped: {self.failure}") from self.failure
        with self._lock:
            return self._versions.get(version)

    def load(self, event: PolicyPublished, backend: str, device: str = "cpu", *, micro_batch_size: int = 8,
             seed: int = 0, keeping: int = -1, current: PolicyModel | None = None,
             precision: str = "float32") -> PolicyModel | None:
        """`load_published`, timed and logged; a version whose checkpoint fails its sha256 check is remembered in
        `refused` (never offered again by `newer_than`) and None is returned: the caller keeps version `keeping`."""
        started = time.perf_counter()
        try:
            policy = load_published(event, backend, device, micro_batch_size=micro_batch_size, seed=seed,
                                    current=current, precision=precision)
        except CheckpointError as exc:
            self.refused.add(event.version)
            log.error("%s version %d refused (%s); keeping version %d", self.role, event.version, exc, keeping)
            return None
        log.info("%s version %d loaded in %.2fs (sha256 %s checked)", self.role, event.version,
                 time.perf_counter() - started, event.sha256[:12])
        return policy

    def wait_for(self, version: int, timeout_s: float) -> PolicyPublished | None:
        """The newest event once its version is at least `version`, or None after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._newest is None or self._newest.version < version:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.failure is not None:
                    return None
                self._changed.wait(min(remaining, 0.2))
            return self._newest

    def _on_record(self, record: Record) -> None:
        try:
            event = decode(POLICY, record.value)
        except EventDecodeError:
            return  # dead-lettered by whoever consumes crl.policy in a runner
        if isinstance(event, PolicyPublished) and event.role == self.role:
            with self._changed:
                self._versions.setdefault(event.version, event)
                if self._newest is None or event.version > self._newest.version:
                    self._newest = event
                    self._changed.notify_all()
