"""Multi-host serving: process 0 runs the engine and HTTP; every other process replays its steps.

The rule (multi-controller JAX): every process issues the same jitted calls with the same host
inputs, in the same order. The leader's `LLM` writes each device call as a `step_ops.StepOp`
and hands it to its step hook before applying it; `CollectiveBroadcaster` sends it to all
processes, and `run_follower` applies each received op with the same `runner.apply`. The
transport is two device broadcasts per op (`broadcast`): a fixed int32[4] header
(magic, format version, payload bytes, 0), then the payload (`step_ops.to_bytes`) as uint8
padded to a power of two >= 4 KiB, so only a few payload shapes ever compile.

    jaxdecode serve --distributed [--coordinator-address HOST:PORT --num-processes N
                                   --process-id I] [--mesh data=D,model=M] ...

Without the three coordinator flags `jax.distributed.initialize()` finds them itself (Cloud TPU,
GKE TPU, SLURM). With one process it is a normal server whose ops loop back through the same
broadcast code.
"""

from __future__ import annotations

import functools
import logging
import queue
from typing import Any, Callable, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdecode.engine import runner, step_ops

logger = logging.getLogger(__name__)

MAGIC = 0x6A617864  # "jaxd"
MIN_PAYLOAD = 4096
MAX_PAYLOAD = 1 << 30


class StepBroadcaster(Protocol):
    """The leader publishes each op before applying it; a follower receives them in order."""

    def publish(self, op: step_ops.StepOp) -> None: ...

    def receive(self) -> step_ops.StepOp: ...


class QueueBroadcaster:
    """In-process transport (tests, notebooks): the serialized ops through a `queue.Queue`."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()

    def publish(self, op: step_ops.StepOp) -> None:
        self._queue.put(step_ops.to_bytes(op))

    def receive(self, timeout: Optional[float] = None) -> step_ops.StepOp:
        return step_ops.from_bytes(self._queue.get(timeout=timeout))


class CollectiveBroadcaster:
    """Ops over device broadcasts from process 0 to all processes (`broadcast`).

    `publish` (process 0) and `receive` (the others) are the two halves of one collective:
    every process must call its half for every op. `publish` returns the op as every process
    decoded it, which lets a single process check the whole path."""

    def __init__(self, is_source: Optional[bool] = None) -> None:
        self.is_source = jax.process_index() == 0 if is_source is None else is_source

    def publish(self, op: step_ops.StepOp) -> step_ops.StepOp:
        if not self.is_source:
            raise RuntimeError("publish: only the source process (0) publishes step ops")
        return self._exchange(step_ops.to_bytes(op))

    def receive(self) -> step_ops.StepOp:
        if self.is_source:
            raise RuntimeError("receive: the source process publishes, it does not receive")
        return self._exchange(b"")

    def _exchange(self, payload: bytes) -> step_ops.StepOp:
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"payload: {len(payload)} bytes, the limit is {MAX_PAYLOAD}")
        header = np.array([MAGIC, step_ops.VERSION, len(payload), 0], np.int32)
        header = broadcast(header, self.is_source)
        if int(header[0]) != MAGIC or int(header[1]) != step_ops.VERSION:
            raise ValueError(f"header: not a step op of format {step_ops.VERSION}: "
                             f"{header.tolist()}")
        size = int(header[2])
        buf = np.zeros((payload_bucket(size),), np.uint8)
        if self.is_source:
            buf[:size] = np.frombuffer(payload, np.uint8)
        return step_ops.from_bytes(broadcast(buf, self.is_source)[:size].tobytes())


def payload_bucket(size: int) -> int:
    """The padded payload length: a power of two >= MIN_PAYLOAD (few compiled shapes)."""
    return max(MIN_PAYLOAD, 1 << max(0, size - 1).bit_length())


def broadcast(x: np.ndarray, is_source: bool) -> np.ndarray:
    """`x` of the source process on every process (every process passes the same shape).

    `multihost_utils.broadcast_one_to_all` without its single-process shortcut: each process
    contributes its value (zeros unless source) along a "processes" mesh axis and a jitted sum
    over that axis leaves the source's value everywhere -- so one process runs the same code."""
    mesh = _process_mesh()
    inp = np.asarray(x) if is_source else np.zeros_like(x)
    arr = multihost_utils.host_local_array_to_global_array(inp[None], mesh,
                                                           PartitionSpec("processes"))
    out = _sum_over_processes(mesh)(arr)
    return np.asarray(jax.device_get(out.addressable_data(0)))


@functools.lru_cache(maxsize=None)
def _process_mesh() -> Mesh:
    devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    return Mesh(devices, ("processes", "local_devices"))


@functools.lru_cache(maxsize=None)
def _sum_over_processes(mesh: Mesh):
    return jax.jit(lambda x: jnp.sum(x, axis=0, dtype=x.dtype),
                   out_shardings=NamedSharding(mesh, PartitionSpec()))


def run_follower(model: Any, params: Any, channel: Any, *, max_slots: int, max_len: int,
                 eos_token_ids: Sequence[int], mesh: Optional[Any] = None,
                 observe: Optional[Callable[[step_ops.StepOp, Any], None]] = None,
                 pages: Optional[int] = None, page_size: int = 16,
                 kv_cache_dtype: str = "auto") -> int:
    """Apply the leader's ops to this process's state until STOP; returns the ops applied.

    The context equals the leader's (`LLM(..., step_hook=)`: outputs replicated). A failing op
    is logged and the loop goes on: the leader meets the same failure and sends RESET.
    `observe(op, output)` sees each applied op (tests compare step outputs with the leader's)."""
    ctx = runner.Context(model, params, max_slots, max_len, tuple(eos_token_ids), mesh,
                         replicate_outputs=True, pages=pages, page_size=page_size,
                         kv_cache_dtype=kv_cache_dtype)
    state, applied = None, 0
    while True:
        op = channel.receive()
        if op.code == step_ops.STOP:
            return applied
        try:
            state, out = runner.apply(ctx, state, op)
        except Exception:  # mirrored on the leader, which resets
            logger.exception("follower: step op %s failed", op.name)
            continue
        applied += 1
        if observe is not None:
            observe(op, out)


def initialize(args: Any) -> None:
    """`jax.distributed.initialize` from the serve flags (None = auto-detect); before any
    device is touched."""
    given = [args.coordinator_address, args.num_processes, args.process_id]
    if any(v is not None for v in given) and not all(v is not None for v in given):
        raise SystemExit("--coordinator-address, --num-processes, --process-id: give all three "
                         "or none (none: detected on Cloud TPU, GKE and SLURM)")
    jax.distributed.initialize(coordinator_address=args.coordinator_address,
                               num_processes=args.num_processes, process_id=args.process_id)
    logger.info("distributed: process %d of %d, %d devices (%d local)", jax.process_index(),
                jax.process_count(), jax.device_count(), jax.local_device_count())
