"""Pipeline parallelism: stage assignment, schedules as data, p2p and the executor."""
