"""A tensor-parallel group of processes behind one engine worker: rank 0 schedules, ranks 1.. follow its steps.

The worker process is rank 0. It starts one follower process per other rank (plain subprocesses: the worker is a
daemon process and may not fork multiprocessing children), sends each its rank over a local authenticated
connection, and all ranks join one torch.distributed group (NCCL on CUDA, gloo on CPU) for the model's all-reduces.
Every step rank 0 sends the followers what it scheduled: per row the request id (its spec the first time), the
positions fed, the block table and the VAE slot, plus the ids of requests that ended. A follower keeps a mirror
`Request` per id and runs the same `Runner` step on its shard, so every collective meets its partner. Each follower
samples the same patch rank 0 does (identical inputs outside the sharded blocks) and appends it to its mirror.

Failure: rank 0 exits as soon as a follower dies (the pool then fails its requests and restarts the whole group);
a follower exits as soon as rank 0 is gone, even when blocked inside a collective.

NVLink multicast stays off in every process (`disable_nvls`): on shared hosts it can take the GPUs out of service.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from engine import ipc
from engine.process_env import child_env, disable_nvls
from engine.settings import EngineSettings

if TYPE_CHECKING:
    from engine.scheduler import ScheduledSeq, Scheduler
    from engine.worker import WorkerConfig

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, port: int, device: torch.device) -> dist.ProcessGroup:
    """Join the group (NCCL on CUDA, gloo on CPU) and check it with one all-reduce."""
    disable_nvls()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != world:
        raise RuntimeError(f"tensor-parallel group check failed: all-reduce gave {probe.item()}, not {world}")
    return dist.group.WORLD


class TensorParallelLeader:
    """Rank 0's side: starts the followers, joins the group, sends each step, watches the followers."""

    def __init__(self, cfg: WorkerConfig):
        disable_nvls()
        self.world = len(cfg.tp_devices)
        port = _free_port()
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, listen_port = listener.address
        self.stopping = False
        entry = "from engine.distributed import follower_main; follower_main()"
        self.procs = [subprocess.Popen([sys.executable, "-c", entry, f"{host}:{listen_port}"], env=child_env(),
                                       stdin=subprocess.PIPE) for _ in range(1, self.world)]
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(authkey.hex().encode() + b"\n")
            proc.stdin.close()
            threading.Thread(target=self._watch, args=(proc,), daemon=True, name="voxgate-tp-watch").start()
        self.conns: list[Connection] = []
        for rank in range(1, self.world):
            conn = listener.accept()
            _send(conn, ipc.RankSetup(cfg=cfg, rank=rank, port=port))
            self.conns.append(conn)
        listener.close()
        self.group = init_group(0, self.world, port, torch.device(cfg.tp_devices[0]))
        self.known: dict[str, object] = {}  # request id -> the Request the followers mirror

    def _watch(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self.stopping:  # its partner collectives would hang: end the whole group, the pool restarts it
            log.error("tensor-parallel follower %d exited with code %s; stopping this worker", proc.pid, code)
            self.abort()

    def abort(self) -> None:
        """End this worker process at once (the followers follow); the pool fails its turns and restarts it."""
        for proc in self.procs:
            proc.kill()
        os._exit(70)

    def send_step(self, seqs: list[ScheduledSeq], scheduler: Scheduler) -> None:
        """What the followers need to run the step rank 0 is about to run."""
        gone = [rid for rid, req in self.known.items() if scheduler.requests.get(rid) is not req]
        for rid in gone:
            del self.known[rid]
        rows: list[ipc.RankRow] = []
        for seq in seqs:
            req = seq.request
            new = self.known.get(req.request_id) is not req
            self.known[req.request_id] = req
            rows.append(ipc.RankRow(request_id=req.request_id, spec=req.spec if new else None, start=seq.start,
                                    num_tokens=seq.num_tokens, emit=seq.emit, block_table=req.block_table,
                                    vae_slot=req.vae_slot))
        msg = pickle.dumps(ipc.RankStep(rows=rows, gone=gone), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(msg)

    def close(self, timeout: float = 5.0) -> None:
        self.stopping = True
        for conn in self.conns:
            with contextlib.suppress(OSError):
                _send(conn, ipc.Stop())
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()


def run_follower(conn: Connection) -> None:
    """A follower rank: join the group, load and shard the model, then run every step rank 0 sends."""
    from engine.checkpoint import load_model
    from engine.host_memory import HeapTrimmer
    from engine.model.parallel import shard_model
    from engine.request import Request
    from engine.runner import Runner
    from engine.scheduler import ScheduledSeq

    setup: ipc.RankSetup = _recv(conn)
    rank, port = setup.rank, setup.port
    cfg = dataclasses.replace(setup.cfg, device=setup.cfg.tp_devices[rank])
    torch.set_num_threads(cfg.worker_threads)
    device = torch.device(cfg.device)
    group = init_group(rank, len(cfg.tp_devices), port, device)
    loaded = load_model(cfg.model, device, cfg.dtype)
    shard_model(loaded.model, rank, len(cfg.tp_devices), group)
    runner = Runner(loaded, cfg)
    requests: dict[str, Request] = {}
    heap = HeapTrimmer()
    while True:
        try:
            msg = _recv(conn)
        except (EOFError, OSError):
            return
        if isinstance(msg, ipc.Stop):
            return
        for rid in msg.gone:
            requests.pop(rid, None)
        seqs = []
        for row in msg.rows:
            if row.spec is not None:
                requests[row.request_id] = Request(row.spec)
            req = requests[row.request_id]
            req.block_table, req.vae_slot = row.block_table, row.vae_slot
            seqs.append(ScheduledSeq(req, row.start, row.num_tokens, row.emit))
        out = runner.step(seqs)
        for seq, patch in zip(seqs, out.patches, strict=True):
            if patch is not None:
                seq.request.generated.append(patch)
        heap.busy()


def _send(conn: Connection, msg: Any) -> None:
    # plain pickle: torch's multiprocessing reductions would pass tensors as shared-memory handles
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _exit_with_parent() -> None:
    """A follower blocked in a collective never sees its connection close: watch the parent instead."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def follower_main() -> None:
    """The follower process: `python -c ... HOST:PORT`, the connection's key on stdin."""
    disable_nvls()
    logging.basicConfig(level=EngineSettings.from_env().log)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    host, port = sys.argv[1].rsplit(":", 1)
    key = bytes.fromhex(sys.stdin.readline().strip())
    run_follower(Client((host, int(port)), authkey=key))
