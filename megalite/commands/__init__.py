"""The subcommands of `megalite` other than train, generate and export-hf: each module adds its
parser (`register`) and turns the parsed flags into a call of the library code that does the
work (data preparation, the memory estimate, the planner, the profiler, the plots), then prints
what it returns. Nothing below imports this package."""
