"""CLI: `python -m verifier_sandbox run|validate|check [--workers N]`.

JSON Lines on stdin -> one result line per input line on stdout, in input order, flushed
per line. Requests run concurrently on a thread pool (the work itself happens in forked
sandbox processes, so threads use every core).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from .protocol import OPS, bad_request, handle


def answer_line(op: str, line: str) -> dict:
    """The reply to one input line (malformed JSON included); never raises."""
    try:
        request = json.loads(line)
    except ValueError as exc:
        return bad_request(op, f"invalid JSON: {exc}")
    return handle(op, request)


def _read(op: str, pool: ThreadPoolExecutor, lines, pending: queue.Queue) -> None:
    for line in lines:
        pending.put(pool.submit(answer_line, op, line.rstrip("\n")))
    pending.put(None)


def serve(op: str, lines, out, workers: int) -> None:
    """Answers every line of `lines` on `out`, in order, while later lines are still running."""
    # The bounded queue is the backpressure: at most a few lines per worker in flight.
    pending: queue.Queue[Future | None] = queue.Queue(maxsize=4 * workers)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        reader = threading.Thread(target=_read, args=(op, pool, lines, pending), daemon=True)
        reader.start()
        while (future := pending.get()) is not None:
            try:
                reply = future.result()
            except Exception as exc:  # handle() should not raise; a line must come anyway
                reply = bad_request(op, f"internal error: {exc}")
            out.write(json.dumps(reply) + "\n")
            out.flush()
        reader.join()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m verifier_sandbox`."""
    parser = argparse.ArgumentParser(prog="python -m verifier_sandbox", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("op", choices=OPS)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="requests verified at once (default: number of cores)")
    args = parser.parse_args(argv)
    serve(args.op, sys.stdin, sys.stdout, max(1, args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
