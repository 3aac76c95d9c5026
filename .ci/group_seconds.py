"""Seconds per test module of a CI run, for the order `pytest -n 2` hands the modules out in (tests/conftest.py).

    PYTEST_ADDOPTS="--durations=0" bash .ci/run > ci.log 2>&1
    python .ci/group_seconds.py ci.log > tests/group_seconds.json

Sums each module's setup + call + teardown times from pytest's `--durations=0` report (a module shared by two
workers is summed whole). Modules under 5 s are left out: the order among those matters little.
"""

import json
import re
import sys
from collections import defaultdict

log = open(sys.argv[1]).read()
# The README's test command's report only: .ci/floors' runs, printed after it, repeat some modules.
end = re.search(r"^=+ .* in [\d.]+s", log, re.M)
seconds: dict[str, float] = defaultdict(float)
for match in re.finditer(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+)", log[:end.end() if end else None], re.M):
    seconds[match.group(2).split("@")[0].split("::")[0]] += float(match.group(1))
kept = {module: round(s) for module, s in sorted(seconds.items(), key=lambda kv: -kv[1]) if s >= 5}
print(json.dumps(kept, indent=1))
