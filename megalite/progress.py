"""The progress bars megalite shows (training steps, data preparation)."""

from tqdm import tqdm


class ProgressBar(tqdm):
    """tqdm without its monitor thread.

    The monitor only forces a refresh of bars that rarely refresh themselves; ours refresh on
    every update. Its thread also takes tqdm's lock every 10 s, and a process forked at that
    moment (the test launcher forks its ranks from the process that ran a single-process
    reference) inherits the lock held by a thread it does not have: its first bar then waits
    forever, and the other ranks with it."""

    monitor_interval = 0
