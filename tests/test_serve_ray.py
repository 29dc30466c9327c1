"""hf_paged on Ray Serve (`tests/ray_serve_checks.py`), run in a pytest process of its own.

`ray.init` in the suite's own process leaves Ray's native signal handlers and threads behind after `ray.shutdown`,
which took the whole suite down later (an abort with no Python traceback); in a child process Ray ends with it.
"""

import subprocess
import sys
from pathlib import Path


def test_ray_serve_checks_pass_in_their_own_process():
    checks = Path(__file__).with_name("ray_serve_checks.py")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", str(checks)],
                         capture_output=True, text=True, timeout=1200, cwd=checks.parent.parent)
    print(run.stdout[-4000:], run.stderr[-2000:])
    assert run.returncode == 0, run.stdout[-4000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
