"""Kill one rank of a `torchrun --max-restarts 1` training job N times and count how often the
restarted job finished, with the time each recovery took (`megalite.benchmarks.restarts` says
what a trial does). For example:

    python tools/restart_trials.py --trials 10
    python tools/restart_trials.py --trials 10 --rdzv c10d
"""

from megalite.benchmarks.restarts import main

if __name__ == "__main__":
    main()
