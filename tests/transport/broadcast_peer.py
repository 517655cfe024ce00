"""A receiver process for the weight-broadcast tests: a real, separate process joining the trainer's weight group.

    python broadcast_peer.py PORT OUT_DIR --transfers K      receive K transfers, save each as OUT_DIR/step_<k>.safetensors
    python broadcast_peer.py PORT OUT_DIR --join-only        join, then exit without answering any transfer

It prints "joined" once it is in the group (tests wait for that line) and "done" before a normal exit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from safetensors.torch import save_file

from primerl.transport.broadcast import GroupClosed
from primerl.transport.broadcast_receiver import BroadcastReceiver


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--transfers", type=int, default=1)
    parser.add_argument("--join-only", action="store_true")
    parser.add_argument("--init-timeout", type=float, default=120.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()

    receiver = BroadcastReceiver("127.0.0.1", args.port, init_timeout_s=args.init_timeout, timeout_s=args.timeout)
    rank = receiver.join()
    print(f"joined rank={rank} backend={receiver.backend}", flush=True)
    if args.join_only:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    received = 0
    try:
        while received < args.transfers:
            transfer = receiver.next_transfer(timeout_s=1.0)
            if transfer is None:
                continue
            tensors = {name: tensor.clone() for name, tensor in receiver.receive(transfer)}
            save_file(tensors, str(args.out / f"step_{transfer.step}.safetensors"))
            receiver.finish(transfer)
            received += 1
    except GroupClosed as e:
        print(f"closed after {received} transfer(s): {e}", flush=True)
    finally:
        receiver.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
