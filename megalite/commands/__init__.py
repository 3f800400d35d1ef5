"""The subcommands of `megalite` other than train, generate and export-hf: each module adds its
parser (`register`) and turns the parsed flags into a call of the library code that does the
work (data preparation, the memory estimate, the planner, the profiler, the plots), then prints
what it returns. Nothing below imports this package."""


def _bounded(kind: type, lowest: float, name: str):
    """An argparse type: `kind` of at least `lowest`, named in argparse's error ("invalid
    <name> value"), which is a usage error (exit 2)."""

    def parse(text: str):
        value = kind(text)
        if not value >= lowest:
            raise ValueError(text)
        return value

    parse.__name__ = name
    return parse


positive_int = _bounded(int, 1, "positive int")
non_negative_int = _bounded(int, 0, "non-negative int")
non_negative_float = _bounded(float, 0.0, "non-negative number")
