"""P4 on one machine: weight-update latency, from "the trainer has the new weights" to "the inference server serves
them", for every weight transfer that can run here, with the real components.

Per mode, a child process (hard timeout, so nothing can hang this script) is trainer rank 0: the real
`primerl.trainer.core.Trainer` — one optimizer step on fake RL data (`primerl.trainer.rl.fake_rows`), then
`Trainer.finish_step`, which publishes the version through the mode's publisher (primerl.transport.weight_transfer)
exactly as `primerl trainer` does — next to a real `primerl inference` server process (embedded engine,
`engine = "hf"`). After each step it does what the orchestrator does, `POST /admin/update_weights {path, step}`, then
one greedy request (`/inference/v1/generate`, temperature 0) whose `policy_versions` show which version answered.
Timed per version:

    e2e_s = trainer step done -> finish_step (export / broadcast + marker) -> POST /admin/update_weights answered

(the orchestrator's polling for the new STABLE directory, `orchestrator.weights_poll_s`, is not included: the POST
goes out as soon as `finish_step` returns). Also recorded: the trainer's `weights_export_s` / `weights_broadcast_s`,
the server's own log line for the update (load time; or receive and apply times), the POST alone.

Modes:
- `filesystem`: full `weights/step_k/` (safetensors, config, tokenizer, STABLE); the server loads it on the POST.
- `broadcast_auto`: backend auto. Trainer and server on the same device (one GPU, or the CPU): auto picks gloo.
- `broadcast_nccl_same_gpu`: backend forced to nccl with both on the one GPU: the group must not form, and the
  trainer falls back to the filesystem (docs/weights.md); records the error text, the time to fall back and the
  fallback's latency. Then `nccl_probe`: primerl's own NCCL group code (`_process_group`, `_broadcast`) run by two
  processes on the same GPU without primerl's refusal in front, to record what NCCL itself says.
- `broadcast_nccl_2gpu`: 2+ GPUs: trainer on GPU 0, server on GPU 1, backend nccl.

The trainer-side publisher is built after the server is up (the trainer is built first with the filesystem
transfer, then its publisher is replaced), so the formation time is the join itself, not the server's start.

    python benchmarks/weight_transfer.py                       # GPU: random-init Qwen3-0.6B (bf16 transfers)
    python benchmarks/weight_transfer.py --cpu                 # dry run: tiny random Qwen3, gloo, CPU
    python benchmarks/weight_transfer.py --budget-s 360        # skip what no longer fits in 360 s
    python benchmarks/weight_transfer.py --smoke               # --cpu, one version per mode

Prints one JSON object and writes it to --out (default benchmarks/results/weight_transfer_h200.json on GPU,
weight_transfer_cpu.json with --cpu; with --smoke only to --out).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import add_smoke_flag, emit, not_run
from trainer import QWEN3_0_6B, TINY, trainer_parts, write_random_model

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MODES = ("filesystem", "shared", "broadcast_auto", "broadcast_nccl_same_gpu", "broadcast_nccl_2gpu")
SERVED = "bench"
PROMPT = list(range(10, 26))  # 16 token ids inside the tiny tokenizer's vocabulary (the server checks them)
GREEDY_TOKENS = 8

# server log lines (primerl.inference.server, engines/hf_weights.py, transport/broadcast.py)
LOADED = re.compile(r"weights: loaded (\S+) as policy version (\d+) in ([\d.]+)s")
COPIED = re.compile(r"weights: copied step (\d+) from the trainer's shared buffer as policy version \d+ in ([\d.]+)s")
RECEIVED = re.compile(r"weights: received step (\d+) by broadcast: (\d+) tensors, ([\d.]+) MB in (\d+) bucket\(s\); "
                      r"receive ([\d.]+)s, apply ([\d.]+)s")
JOINED = re.compile(r"joined weight group \S+ at \S+ as rank (\d+) of (\d+) \((\w+)\)")
NOT_JOINED = re.compile(r"weight broadcast: not joined, only filesystem snapshots can be loaded: (.*)")
RECEIVER_STOPPED = re.compile(r"weight broadcast: the receiver stopped|weight broadcast not applied: (.*)")


# ---------------------------------------------------------------------------------------------------------------------
# Child: one mode = one trainer (this process) + one inference server


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    transfer: str  # filesystem | broadcast
    backend: str | None  # requested broadcast backend
    server_gpu: int  # index into the visible GPUs (GPU runs)
    sender_init_timeout_s: float
    timeout_s: float


SPECS = {
    "filesystem": ModeSpec("filesystem", None, 0, 0, 0),
    "shared": ModeSpec("shared", None, 0, 0, 60),
    "broadcast_auto": ModeSpec("broadcast", "auto", 0, 60, 60),
    "broadcast_nccl_same_gpu": ModeSpec("broadcast", "nccl", 0, 30, 20),
    "broadcast_nccl_2gpu": ModeSpec("broadcast", "nccl", 1, 60, 60),
}


def run_child(args: argparse.Namespace) -> int:
    """Trainer rank 0 of one mode, with its own inference server; writes work_dir/result.json as it goes."""
    import httpx
    import torch

    from primerl.config.trainer import BroadcastConfig, RolloutDataConfig, WeightsConfig
    from primerl.launch.local import ADMIN_TOKEN_VAR, free_port
    from primerl.launch.processes import ManagedProcess, child_environment, primerl_command, stop_all
    from primerl.trainer.core import Trainer, micro_batches, setup_logging
    from primerl.trainer.loss import load_loss
    from primerl.trainer.rl import fake_rows, fill_on_policy_logprobs, make_rl_loss
    from primerl.trainer.weights import PolicyWeights, export_plan
    from primerl.transport import snapshots
    from primerl.transport.broadcast import _device_label
    from primerl.transport.weight_transfer.factory import build_publisher
    from primerl.transport.weight_transfer.modes import FILESYSTEM, transfer_mode

    setup_logging(0, "bench-trainer")
    deadline = time.monotonic() + args.timeout_s
    spec = SPECS[args.child]
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / "run"
    result: dict[str, Any] = {"mode": args.child, "status": "started", "transfer": spec.transfer,
                              "backend_requested": spec.backend}

    def save() -> None:
        (work / "result.json").write_text(json.dumps(result, indent=2) + "\n")

    save()
    gpus = [g for g in (args.gpus or "").split(",") if g]  # the parent's view (this process sees only the first)
    port, store_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    token = "bench-" + os.urandom(8).hex()
    server_args = [
        "inference", f"--model.name={args.model_dir}", "--engine=hf", f"--device={'cpu' if args.cpu else 'cuda'}",
        "--host=127.0.0.1", f"--port={port}", f"--served_model_name={SERVED}", "--max_model_len=256",
        "--max_batch_size=4", "--log_level=info",
    ]
    server_args.append(f"--weight_transfer={spec.transfer}")
    if transfer_mode(spec.transfer).weight_group:
        server_args += [f"--weight_broadcast.port={store_port}",
                        f"--weight_broadcast.init_timeout_s={max(args.timeout_s, 30):g}",
                        f"--weight_broadcast.timeout_s={spec.timeout_s:g}"]
    extra = {ADMIN_TOKEN_VAR: token}
    if gpus:
        extra["CUDA_VISIBLE_DEVICES"] = gpus[spec.server_gpu]
    server = ManagedProcess("inference", primerl_command(*server_args), work / "inference.log",
                            child_environment(extra), cwd=REPO)
    started = time.perf_counter()
    server.start()
    (work / "server.pid").write_text(str(server.pid))
    result["server_command"] = " ".join(server.argv)
    trainer = None
    try:
        # the trainer loads while the server starts (as under `rl`)
        parts = trainer_parts(run_dir, args.model_dir, optim={"lr": args.lr}, weights={"interval": 1, "keep_last": 2},
                              train={"device": "cpu" if args.cpu else "cuda", "compile": False, "micro_batch_rows": 1})
        t = time.perf_counter()
        trainer = Trainer(parts, source="benchmark")
        result["trainer_build_s"] = time.perf_counter() - t
        plan = export_plan(trainer.policy, trainer.export_dtype)
        result["model_bytes"] = sum(_numel(e.shape) * e.dtype.itemsize for e in plan)
        result["num_tensors"] = len(plan)
        result["export_dtype"] = str(trainer.export_dtype).removeprefix("torch.")
        result["layout"] = {
            "trainer": f"{trainer.device} ({_device_label(trainer.device)})",
            "server": "cpu" if not gpus else f"CUDA_VISIBLE_DEVICES={gpus[spec.server_gpu]}",
        }
        step_loss = make_rl_loss(load_loss("primerl.trainer.loss:masked_importance_loss"))
        data = RolloutDataConfig(fake=True, fake_samples=2, fake_sample_tokens=64, fake_seq_len=128)
        vocab = trainer.policy.causal_lm.config.vocab_size
        save()

        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=httpx.Timeout(max(spec.timeout_s, 60.0)))
        _wait_healthy(http, server, deadline)
        result["server_startup_s"] = time.perf_counter() - started
        initial = _greedy(http)  # the first request also warms up the decoder (CUDA graphs)
        result["initial_request"] = initial
        save()

        if transfer_mode(spec.transfer) is not FILESYSTEM:  # the publisher of the mode, (re)built once the server is healthy
            group = BroadcastConfig(host="127.0.0.1", port=store_port, receivers=1, backend=spec.backend,
                                    init_timeout_s=spec.sender_init_timeout_s, timeout_s=spec.timeout_s
                                    ) if transfer_mode(spec.transfer).weight_group else BroadcastConfig()
            wcfg = WeightsConfig(interval=1, keep_last=2, transfer=spec.transfer, shared_timeout_s=spec.timeout_s,
                                 broadcast=group)
            trainer.publisher.close()
            t = time.perf_counter()
            source = PolicyWeights(trainer.policy, trainer.tokenizer, trainer.export_dtype, trainer.dist,
                                   trainer.device)
            trainer.publisher = publisher = build_publisher(wcfg, source, run_dir)
            built_s = time.perf_counter() - t
            trainer.parts = dataclasses.replace(trainer.parts, weights=wcfg)
            result["publisher_label"] = publisher.label
        if transfer_mode(spec.transfer).weight_group:
            if publisher.sending:
                result["group_formation_s"] = built_s
                result["group_backend"] = getattr(publisher, "backend", None)
            else:
                result["fallback_s"] = built_s
                result["fallback_reason"] = publisher.fallback
            result["server_receiver"] = _receiver_log(server.log_path, wait_s=3.0)
            save()

        repeats = []
        result["repeats"] = repeats
        previous = [initial["token_ids"], initial["first_logprobs"]]
        for step in range(1, args.repeats + 1):
            if repeats and time.monotonic() + 2 * repeats[-1]["repeat_s"] + 20 > deadline:
                result["note"] = f"stopped after {len(repeats)} repeat(s): the mode's time limit was near"
                break
            t_repeat = time.perf_counter()
            batch = micro_batches(fake_rows(data, vocab, step, 0, 1, 0), 1, trainer.device)
            fill_on_policy_logprobs(trainer, batch)
            metrics = trainer.step(batch, step_loss)  # synchronises the device at its end
            t0 = time.perf_counter()
            trainer.finish_step(step, metrics, {"next_rollout_step": step}, is_last=False)
            t_published = time.perf_counter()
            path = snapshots.weights_dir(run_dir, step)
            if not snapshots.is_stable(path):
                raise RuntimeError(f"finish_step returned without a STABLE {path}")
            response = http.post("/admin/update_weights", json={"path": str(path), "step": step},
                                 headers={"Authorization": f"Bearer {token}"})
            t_served = time.perf_counter()
            if response.status_code != 200:
                raise RuntimeError(f"POST /admin/update_weights: {response.status_code} {response.text[:500]}")
            state = response.json()
            greedy = _greedy(http)
            answer = [greedy["token_ids"], greedy["first_logprobs"]]
            marker = snapshots.marker(path, snapshots.BROADCAST)
            mode = transfer_mode(spec.transfer)
            record = {
                "step": step,
                "e2e_s": t_served - t0,
                "finish_step_s": t_published - t0,
                "update_request_s": t_served - t_published,
                "server_policy_version": state["policy_version"],
                "weight_transfer": metrics.get("weight_transfer"),
                "backend": marker.get("backend") if marker else mode.name if mode.shared_memory else FILESYSTEM.name,
                "has_files": snapshots.has_files(path),
                **{k: metrics[k] for k in ("weights_export_s", "weights_broadcast_s", "weights_broadcast_bytes",
                                           "weights_broadcast_buckets", "weights_shared_s", "weights_shared_wait_s")
                   if k in metrics},
                "trainer_step_s": metrics.get("step_s"),
                "loss": metrics.get("loss"),
                "server_log": _update_log(server.log_path, step, wait_s=3.0),
                "greedy": {**greedy, "serves_new_version": greedy["policy_versions"] == [step]
                           and greedy["header_version"] == step, "changed": answer != previous},
            }
            previous = answer
            record["repeat_s"] = time.perf_counter() - t_repeat
            repeats.append(record)
            save()
        result["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - recorded; the parent carries on with the next mode
        result["status"] = "error"
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        if trainer is not None:
            with contextlib.suppress(Exception):
                trainer.close()
        stop_all([server], grace_s=15)
        result["server_exit"] = server.poll()
        result["server_log_tail"] = server.tail(25) if result["status"] != "ok" else None
        result["mode_wall_s"] = time.perf_counter() - started
        result["torch"] = torch.__version__
        save()
    return 0 if result["status"] == "ok" else 1


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _wait_healthy(http, server, deadline: float) -> None:
    import httpx

    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the inference server exited with code {server.poll()}:\n{server.tail(20)}")
        with contextlib.suppress(httpx.TransportError):
            if http.get("/health").status_code == 200:
                return
        time.sleep(0.25)
    raise TimeoutError("the inference server was not healthy within the mode's time limit")


def _greedy(http) -> dict[str, Any]:
    body = {"model": SERVED, "token_ids": PROMPT, "sampling_params": {
        "n": 1, "temperature": 0.0, "max_tokens": GREEDY_TOKENS, "ignore_eos": True, "logprobs": 1}}
    t = time.perf_counter()
    response = http.post("/inference/v1/generate", json=body)
    latency = time.perf_counter() - t
    if response.status_code != 200:
        raise RuntimeError(f"greedy request: {response.status_code} {response.text[:500]}")
    choice = response.json()["choices"][0]
    logprobs = [round(e["logprob"], 4) for e in ((choice.get("logprobs") or {}).get("content") or [])[:3]]
    return {"token_ids": choice["token_ids"], "first_logprobs": logprobs,
            "policy_versions": choice.get("policy_versions"),
            "header_version": int(response.headers.get("X-Policy-Version", -1)), "latency_s": latency}


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _update_log(path: Path, step: int, wait_s: float) -> dict[str, Any] | None:
    """The server's own line about version `step` (the receiver thread may log it just after confirming)."""
    deadline = time.monotonic() + wait_s
    while True:
        text = _read(path)
        for m in RECEIVED.finditer(text):
            if int(m.group(1)) == step:
                return {"how": "broadcast", "num_tensors": int(m.group(2)), "mb": float(m.group(3)),
                        "buckets": int(m.group(4)), "receive_s": float(m.group(5)), "apply_s": float(m.group(6))}
        for m in LOADED.finditer(text):
            if int(m.group(2)) == step:
                return {"how": "filesystem", "load_s": float(m.group(3))}
        for m in COPIED.finditer(text):
            if int(m.group(1)) == step:
                return {"how": "shared", "copy_s": float(m.group(2))}
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _receiver_log(path: Path, wait_s: float) -> dict[str, Any]:
    """What the server's weight receiver said about joining."""
    deadline = time.monotonic() + wait_s
    while True:
        text = _read(path)
        if m := JOINED.search(text):
            return {"joined": True, "rank": int(m.group(1)), "world_size": int(m.group(2)), "backend": m.group(3)}
        if m := NOT_JOINED.search(text):
            return {"joined": False, "error": m.group(1).strip()}
        if time.monotonic() > deadline:
            tail = [line for line in text.splitlines() if "weight" in line.lower()][-5:]
            return {"joined": None, "note": "no join line in the server log yet", "weight_lines": tail}
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------------------------------
# NCCL probe: two processes, one GPU, primerl's own NCCL group code without its same-GPU refusal


def probe_parts():
    """primerl's own group code that the probe runs (imported by a smoke run too, which cannot run the probe)."""
    from primerl.transport.broadcast import _broadcast, _process_group, _short, _store

    return _broadcast, _process_group, _short, _store


def run_probe_rank(args: argparse.Namespace) -> int:
    import torch

    _broadcast, _process_group, _short, _store = probe_parts()
    rank, timeout_s = args.nccl_probe_rank, args.probe_timeout_s
    out: dict[str, Any] = {"rank": rank}
    t = time.perf_counter()
    try:
        torch.cuda.set_device(0)
        out["device"] = f"cuda:0 ({torch.cuda.get_device_properties(0).uuid})"
        store = _store("127.0.0.1", args.probe_port, is_master=rank == 0, timeout_s=timeout_s)
        group = _process_group("nccl", store, rank, 2, timeout_s, "127.0.0.1")
        out["constructed"] = True
        token = torch.full((1,), 1234 if rank == 0 else 0, dtype=torch.int64, device="cuda:0")
        _broadcast(group, token, timeout_s)
        torch.cuda.synchronize()
        out.update(ok=True, received=int(token.item()))
    except Exception as e:  # noqa: BLE001 - the point is to record it
        out.update(ok=False, error=_short(e), error_full=str(e)[:3000])
    out["seconds"] = time.perf_counter() - t
    with contextlib.suppress(Exception):
        out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    print("PROBE " + json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)  # no NCCL teardown: a communicator in an error state may block in its destructor


def nccl_probe(work: Path, gpu: str, limit_s: float) -> dict[str, Any]:
    from primerl.launch.local import free_port
    from primerl.launch.processes import ManagedProcess, child_environment

    work.mkdir(parents=True, exist_ok=True)
    port = free_port("127.0.0.1")
    env = child_environment({"CUDA_VISIBLE_DEVICES": gpu, "NCCL_DEBUG": "WARN"})
    procs = [ManagedProcess(f"nccl-probe-{rank}", [
        sys.executable, str(Path(__file__).resolve()), "--nccl-probe-rank", str(rank), "--probe-port", str(port),
        "--probe-timeout-s", str(max(5.0, limit_s / 3))], work / f"rank{rank}.log", env, cwd=REPO) for rank in (0, 1)]
    started = time.perf_counter()
    for p in procs:
        p.start()  # own process group, dies with this process
    timed_out = False
    deadline = time.monotonic() + limit_s
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for p in procs:
        _kill_group(p.pid)
        p.popen.wait()
    ranks, nccl_lines = [], []
    for rank in (0, 1):
        text = _read(work / f"rank{rank}.log")
        found = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("PROBE ")]
        ranks.append(found[0] if found else {"rank": rank, "ok": None, "log_tail": text.splitlines()[-15:]})
        nccl_lines += [line.strip() for line in text.splitlines() if "NCCL" in line and "WARN" in line][:6]
    return {
        "what": "two processes on the same GPU build primerl's NCCL weight group (transport.broadcast."
                "_process_group + _broadcast, the code the trainer and receivers run) without primerl's same-GPU "
                "refusal in front: what NCCL itself does",
        "timed_out": timed_out, "seconds": time.perf_counter() - started, "ranks": ranks,
        "nccl_warnings": nccl_lines,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Parent


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_mode(args: argparse.Namespace, mode: str, model_dir: Path, work: Path, limit_s: float,
             gpus: list[str]) -> dict[str, Any]:
    from primerl.launch.processes import ManagedProcess, stop_all

    # the forced-nccl mode measures the filesystem fallback: two versions show it, the time goes to the other modes
    repeats = min(args.repeats, 2) if mode == "broadcast_nccl_same_gpu" else args.repeats

    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--model-dir", str(model_dir),
           "--work-dir", str(work), "--repeats", str(repeats), "--lr", str(args.lr),
           "--timeout-s", f"{max(limit_s - 25, 20):.0f}", "--gpus", ",".join(gpus)] + (["--cpu"] if args.cpu else [])
    log_path = work / "child.log"
    started = time.perf_counter()
    timed_out = False
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus[0]} if gpus else None  # the trainer: the first GPU
    # its own process group, SIGTERM when this process dies
    child = ManagedProcess(f"weight-transfer-{mode}", cmd, log_path, env, cwd=REPO)
    child.start()
    try:
        child.popen.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop_all([child], grace_s=10)  # SIGINT, then SIGKILL to its group
    result_file = work / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {"mode": mode, "status": "no result"}
    pid_file = work / "server.pid"  # the server runs in a session of its own: if the child did not stop it, we do
    if pid_file.exists() and result.get("server_exit") is None:
        _kill_group(int(pid_file.read_text()))
    if args.logs_dir is not None:
        keep = args.logs_dir / mode
        keep.mkdir(parents=True, exist_ok=True)
        for name in ("child.log", "inference.log", "result.json"):
            if (work / name).exists():
                shutil.copy(work / name, keep / name)
    if timed_out:
        result["status"] = f"timeout after {limit_s:.0f}s (hard limit; child killed)"
    result["child_exit"] = child.poll()
    result["child_wall_s"] = time.perf_counter() - started
    if result.get("status") != "ok":
        result["child_log_tail"] = _read(log_path).splitlines()[-30:]
    return summarise(result)


def summarise(r: dict[str, Any]) -> dict[str, Any]:
    repeats = r.get("repeats") or []
    if not repeats:
        return r
    e2e = [x["e2e_s"] for x in repeats]
    backends = sorted({x["backend"] for x in repeats})
    summary: dict[str, Any] = {
        "e2e_s_median": statistics.median(e2e),
        "e2e_s_all": e2e,
        "bytes_per_s": r["model_bytes"] / statistics.median(e2e),
        "backend_used": backends[0] if len(backends) == 1 else backends,
        "weight_transfer_label": repeats[-1].get("weight_transfer"),
        "fallback_reason": r.get("fallback_reason"),
        "serves_new_version_every_time": all(x["greedy"]["serves_new_version"] for x in repeats),
    }
    for key in ("weights_export_s", "weights_broadcast_s", "weights_shared_s", "finish_step_s", "update_request_s"):
        values = [x[key] for x in repeats if x.get(key) is not None]
        if values:
            summary[f"{key}_median"] = statistics.median(values)
    for key in ("load_s", "receive_s", "apply_s", "copy_s"):
        values = [x["server_log"][key] for x in repeats if x.get("server_log") and key in x["server_log"]]
        if values:
            summary[f"server_{key}_median"] = statistics.median(values)
    if "weights_broadcast_s_median" in summary:
        summary["broadcast_bytes_per_s"] = r["model_bytes"] / summary["weights_broadcast_s_median"]
    return {"summary": summary, **r}


def same_weights(results: dict[str, Any]) -> dict[str, Any]:
    """Every mode trains the same steps from the same weights on the same data, so version k should answer the
    greedy request alike whatever carried it: the largest difference of its first log-probs across modes."""
    by_step: dict[int, dict[str, list[float]]] = {}
    for mode, r in results.items():
        for x in r.get("repeats") or []:
            by_step.setdefault(x["step"], {})[mode] = x["greedy"]["first_logprobs"]
    diffs = {}
    for step, per_mode in sorted(by_step.items()):
        rows = [v for v in per_mode.values() if v]
        if len(rows) > 1 and all(len(v) == len(rows[0]) for v in rows):
            diffs[str(step)] = max(abs(a - b) for v in rows for a, b in zip(v, rows[0], strict=True))
    return {"what": "per version: max |difference| of the greedy answer's first 3 log-probs across modes",
            "max_abs_diff_per_version": diffs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU: tiny random Qwen3, gloo")
    parser.add_argument("--modes", default=",".join(MODES), help="modes to run, in order")
    parser.add_argument("--repeats", type=int, default=3, help="versions published per mode (median reported)")
    parser.add_argument("--model-dir", type=Path, help="random model directory to use (written there if missing)")
    parser.add_argument("--lr", type=float, default=1e-3, help="trainer learning rate (big: greedy answers change)")
    parser.add_argument("--mode-timeout-s", type=float, default=None, help="hard limit per mode (GPU 150, CPU 240)")
    parser.add_argument("--budget-s", type=float, default=None, help="skip modes that no longer fit in this time")
    parser.add_argument("--no-nccl-probe", action="store_true", help="skip the raw NCCL same-GPU probe")
    parser.add_argument("--out", type=Path, help="JSON output (default benchmarks/results/weight_transfer_*.json)")
    parser.add_argument("--logs-dir", type=Path, help="keep each mode's child and server logs here")
    add_smoke_flag(parser)
    # internal: one mode's child process, one rank of the NCCL probe
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=120.0, help=argparse.SUPPRESS)
    parser.add_argument("--gpus", default="", help=argparse.SUPPRESS)
    parser.add_argument("--nccl-probe-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--probe-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--probe-timeout-s", type=float, default=20.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args)
    if args.nccl_probe_rank is not None:
        return run_probe_rank(args)
    if args.smoke:
        args.cpu, args.repeats = True, 1

    started = time.monotonic()
    modes = [m for m in args.modes.split(",") if m]
    if unknown := sorted(set(modes) - set(MODES)):
        parser.error(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    # GPU numbers mean the same to nvidia-smi (visible_gpus) and to CUDA in every process started from here
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    import torch
    import transformers

    from primerl.launch.local import visible_gpus
    from primerl.multicast import multicast_off

    multicast_off(os.environ)  # children inherit it (the servers get it from child_environment anyway)
    num_gpus = 0 if args.cpu else torch.cuda.device_count()
    gpus = [] if args.cpu else (visible_gpus() or [str(i) for i in range(num_gpus)])
    if not args.cpu and num_gpus == 0:
        print("weight_transfer: no GPU visible; --cpu runs the dry run", file=sys.stderr)
        return 2
    limit = args.mode_timeout_s or (240.0 if args.cpu else 150.0)
    out = args.out or (None if args.smoke else RESULTS / ("weight_transfer_cpu.json" if args.cpu else
                                                          "weight_transfer_h200.json"))

    device: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                              "python": sys.version.split()[0]}
    if args.cpu:
        device.update(kind="cpu", cpus=os.cpu_count())
    else:
        props = torch.cuda.get_device_properties(0)
        device.update(kind="cuda", gpu=torch.cuda.get_device_name(0), gpus_visible=num_gpus,
                      gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                      nccl=".".join(map(str, torch.cuda.nccl.version())),
                      gpu_uuids=[str(torch.cuda.get_device_properties(i).uuid) for i in range(num_gpus)])

    results: dict[str, Any] = {}
    smoke: dict[str, Any] = {}  # a smoke run's not_run
    probe = None
    with tempfile.TemporaryDirectory(prefix="weight-transfer-") as tmp:
        tmp = Path(tmp)
        model_dir = args.model_dir or tmp / "model"
        arch, label = (TINY, "tiny Qwen3 (2 layers, vocab 2048), random init") if args.cpu else (
            QWEN3_0_6B, "Qwen3-0.6B architecture, random init")
        t = time.perf_counter()
        if not (model_dir / "config.json").exists():
            print(f"weight_transfer: writing the random model to {model_dir}", file=sys.stderr, flush=True)
            write_random_model(arch, model_dir)
        model_write_s = time.perf_counter() - t
        for mode in modes:
            reason = None
            if mode == "broadcast_nccl_same_gpu" and args.cpu:
                reason = "not applicable on the CPU: NCCL needs GPUs (a CPU run of backend nccl is refused at once)"
            if mode == "broadcast_nccl_2gpu" and num_gpus < 2:
                reason = f"not applicable: needs 2 GPUs, {num_gpus} visible"
            remaining = None if args.budget_s is None else args.budget_s - (time.monotonic() - started)
            if reason is None and remaining is not None and remaining < 45:
                reason = f"skipped: {remaining:.0f}s of the {args.budget_s:.0f}s budget left"
            if reason is not None:
                results[mode] = {"mode": mode, "status": reason}
                print(f"weight_transfer: {mode}: {reason}", file=sys.stderr, flush=True)
                continue
            mode_limit = limit if remaining is None else min(limit, remaining - 10)
            print(f"weight_transfer: {mode} (limit {mode_limit:.0f}s)", file=sys.stderr, flush=True)
            results[mode] = run_mode(args, mode, model_dir, tmp / mode, mode_limit, gpus)
            summary = results[mode].get("summary", {})
            print(f"weight_transfer: {mode}: {results[mode].get('status')} e2e median "
                  f"{summary.get('e2e_s_median')} backend {summary.get('backend_used')}", file=sys.stderr, flush=True)
            if mode == "broadcast_nccl_same_gpu" and not args.no_nccl_probe:
                remaining = None if args.budget_s is None else args.budget_s - (time.monotonic() - started)
                if remaining is None or remaining > 40:
                    print("weight_transfer: nccl probe", file=sys.stderr, flush=True)
                    probe = nccl_probe(tmp / "nccl_probe", gpus[0] if gpus else "0", 45.0)
                    if args.logs_dir is not None:
                        shutil.copytree(tmp / "nccl_probe", args.logs_dir / "nccl_probe", dirs_exist_ok=True)
                else:
                    probe = {"status": "skipped: out of time"}
        if args.smoke:  # what the CPU cannot run: named, and the probe's code at least imported
            for mode in modes:
                if str(results[mode].get("status", "")).startswith("not applicable"):
                    not_run(smoke, mode, results[mode]["status"])
            probe_parts()
            not_run(smoke, "nccl_probe", "needs a CUDA device (two processes on one GPU)")

    model_bytes = next((r["model_bytes"] for r in results.values() if "model_bytes" in r), None)
    result = {
        "benchmark": "P4 weight-update latency: trainer has version k -> inference server serves version k",
        "what": "e2e_s per version: from the end of the trainer's optimizer step (device synchronised) through "
                "Trainer.finish_step (the publisher: full export, shared buffer, or broadcast + marker) to the answer "
                "of POST /admin/update_weights {path, step} (the orchestrator's call; its polling interval is not "
                "included). Then a greedy /inference/v1/generate request shows the version that answers. bytes_per_s = "
                "model_bytes / median e2e_s.",
        "driver": "per mode a child process acting as trainer rank 0 runs the real primerl.trainer.core.Trainer "
                  "(step on fake RL data, then finish_step -> Publisher.publish), not the `primerl trainer` "
                  "CLI loop, so that every version's start time is exact and the next version waits until the "
                  "server serves this one; the server is the real `primerl inference` process (engine hf). For "
                  "broadcast modes the publisher is (re)built after the server is healthy.",
        "model": label,
        "model_bytes": model_bytes,
        "model_write_s": model_write_s,
        "repeats": args.repeats,
        "device": device,
        "layout": "CPU: trainer and server on the CPU" if args.cpu else (
            f"trainer GPU {gpus[0] if gpus else 0}; server on the same GPU (modes 1-3)"
            + (f", on GPU {gpus[1]} (2gpu mode)" if num_gpus > 1 and len(gpus) > 1 else "")),
        "summary": {m: r.get("summary", {"status": r.get("status")}) for m, r in results.items()},
        "modes": results,
        "nccl_probe": probe,
        "same_weights_across_modes": same_weights(results),
        "wall_s": time.monotonic() - started,
    }
    emit({**result, **smoke}, out, smoke=args.smoke)
    ran = [r for r in results.values() if not str(r.get("status", "")).startswith(("not ", "skip"))]
    ok = [r.get("status") == "ok" for r in ran]
    return 0 if ok and all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
