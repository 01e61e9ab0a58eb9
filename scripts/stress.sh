#!/usr/bin/env bash
# Runs the distributed suite N times in a row (default 5) and prints what it tried and how each try ended:
# clear errors (tests that expect every rank to fail cleanly), defined results (tests against the reference),
# failures, hangs (a harness timeout) and the time from an injected fault until every rank had exited.
#   scripts/stress.sh [N] [pytest selection...]      e.g. scripts/stress.sh 5 tests/distributed
set -uo pipefail
cd "$(dirname "$0")/.."
repeats="${1:-5}"
shift || true
selection=("${@:-tests/distributed}")
out="$(mktemp -d)"
for i in $(seq 1 "$repeats"); do
    timeout 3600 python -m pytest -q -p no:cacheprovider -s --junitxml="$out/run$i.xml" "${selection[@]}" \
        >"$out/run$i.log" 2>&1
    echo "run $i: exit $? ($(tail -n 1 "$out/run$i.log"))"
done
python - "$out" "$repeats" <<'PY'
import re, statistics, sys
from pathlib import Path
from xml.etree import ElementTree

out, repeats = Path(sys.argv[1]), int(sys.argv[2])
tried = clear = defined = failed = hangs = 0
times = []
error_words = ("refused", "raises", "error", "ends_every_rank", "time_out", "crashes")
for run in range(1, repeats + 1):
    for case in ElementTree.parse(out / f"run{run}.xml").iter("testcase"):
        if case.find("skipped") is not None:
            continue
        tried += 1
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            failed += 1
            hangs += "hang:" in (problem.get("message", "") + (problem.text or ""))
        elif any(word in case.get("name", "") for word in error_words):
            clear += 1
        else:
            defined += 1
    log = (out / f"run{run}.log").read_text()
    times += [float(t) for t in re.findall(r"(?:raise|exit|kill|stall|none|nograd)\S* (\d+\.\d)s", log)]
print(f"tried {tried}  clear-error {clear}  defined {defined}  failed {failed}  hangs {hangs}")
if times:
    print(f"time to failure over {len(times)} injected faults: median {statistics.median(times):.1f}s,"
          f" max {max(times):.1f}s")
print(f"logs: {out}")
sys.exit(1 if failed else 0)
PY
