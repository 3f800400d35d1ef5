"""The test ids that pytest selects with each of several option lists, collected in one process
(the suite's modules are imported once, not once per list): `python collect_ids.py JSON`, where
JSON is a list of option lists; prints a JSON list of id lists."""

import json
import sys

import pytest


class _Selected:
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.ids = [item.nodeid for item in session.items]


def main() -> None:
    selections = []
    for options in json.loads(sys.argv[1]):
        selected = _Selected()
        code = pytest.main([*options, "--collect-only", "-qq"], plugins=[selected])
        if code != pytest.ExitCode.OK:
            raise SystemExit(f"collecting with {options} failed: exit code {code}")
        selections.append(selected.ids)
    print(json.dumps(selections))


if __name__ == "__main__":
    main()
