"""`python -m jaxserve.diagnose --url http://127.0.0.1:8000`: a running server's symptoms,
each with the box it belongs to, the evidence and the knob to turn (GET /debug/diagnose),
printed for a terminal. `--request ID` prints one request's time by box and its events."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any


def fetch(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def format_findings(findings: list[dict[str, str]]) -> str:
    if not findings:
        return "healthy: no symptoms in the last minute"
    lines = []
    for f in findings:
        lines += [f"[{f['box']}] {f['symptom']}", f"    evidence: {f['evidence']}",
                  f"    advice:   {f['advice']}"]
    return "\n".join(lines)


def format_trace(trace: dict[str, Any]) -> str:
    s = trace["summary"]
    lines = [f"request {trace['id']}"]
    if "time_by_box" in s:
        lines.append("time by box: " + ", ".join(f"{b} {v:.3f} s" for b, v in s["time_by_box"].items()))
        for k in ("ttft_s", "queue_s", "e2e_s", "num_steps", "prefill_steps", "num_preemptions"):
            lines.append(f"  {k}: {s[k]}")
    t0 = trace["events"][0]["start"] if trace["events"] else 0.0
    for e in trace["events"]:
        extra = {k: v for k, v in e.items() if k not in ("box", "name", "start", "end")}
        lines.append(f"  +{e['start'] - t0:8.4f} s {e['end'] - e['start']:8.4f} s  "
                     f"{e['box']:<17} {e['name']:<18} {json.dumps(extra) if extra else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxserve.diagnose", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--request", default=None, metavar="ID", help="print this request's trace")
    args = p.parse_args(argv)
    base = args.url.rstrip("/")
    try:
        if args.request:
            print(format_trace(fetch(f"{base}/debug/requests/{args.request}")))
        else:
            print(format_findings(fetch(f"{base}/debug/diagnose")["findings"]))
    except urllib.error.HTTPError as e:
        print(f"{e.code}: {e.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as e:
        print(f"cannot reach {base}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
