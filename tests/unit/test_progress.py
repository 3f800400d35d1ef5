"""megalite's progress bars start no thread: a thread holding tqdm's lock when the launcher
forks its ranks would leave a rank's first bar waiting forever."""

import subprocess
import sys

SHOW_BARS = """
import threading
from megalite.progress import ProgressBar
with ProgressBar(total=3, mininterval=0) as bar:
    for _ in range(3):
        bar.update(1)
print(sorted(t.name for t in threading.enumerate()))
"""


def test_a_progress_bar_starts_no_monitor_thread():
    """In a fresh process (a monitor another bar started here would hide a new one)."""
    done = subprocess.run(
        [sys.executable, "-c", SHOW_BARS], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "['MainThread']", done.stdout
    assert "3/3" in done.stderr  # it did draw the bar
