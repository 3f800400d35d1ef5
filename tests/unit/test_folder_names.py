"""From a checkout's root the top-level folder `kernels/` is importable by its bare name, and
transformers imports that name when it probes for Hugging Face's `kernels` package. The folder
then gives the name away (`megalite.folder_names`): its kernels never run twice, and a real
`kernels` package installed further along sys.path is the one transformers gets; in a checkout
where megalite is not installed, the name is an empty module."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run_in_checkout(code: str, *flags: str, **env: str) -> dict:
    """Run `code` with the checkout's root as working directory and first sys.path entry, as
    `python -m megalite` or `python -m pytest` there do; it prints one JSON object."""
    result = subprocess.run(
        [sys.executable, *flags, "-c", code],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.splitlines()[-1])


def test_transformers_probe_does_not_import_the_kernels_twice():
    seen = _run_in_checkout(
        "import json, sys\n"
        "from pathlib import Path\n"
        "import transformers.activations  # probes for Hugging Face's `kernels` by importing it\n"
        "import megalite.kernels\n"
        "folder = Path(megalite.kernels.__file__).resolve().parent\n"
        "def ours(module):\n"
        "    file = getattr(module, '__file__', None)\n"
        "    return file is not None and Path(file).resolve().parent == folder\n"
        "loaded = {id(m) for m in list(sys.modules.values()) if ours(m)}\n"
        "canonical = {id(m) for n, m in list(sys.modules.items())\n"
        "             if n.startswith('megalite.kernels')}\n"
        "print(json.dumps({'copies': len(loaded - canonical), 'probed': 'kernels' in sys.modules}))"
    )
    # the probe got an answer (`kernels` is bound: to megalite.kernels, or to an installed
    # package of that name), and no module of the folder exists twice
    assert seen == {"copies": 0, "probed": True}


def test_an_installed_kernels_package_keeps_its_name(tmp_path):
    installed = tmp_path / "kernels"
    installed.mkdir()
    (installed / "__init__.py").write_text('__version__ = "0.12.0"\nWHO = "the hub package"\n')
    seen = _run_in_checkout(
        "import json, sys, kernels\n"
        "print(json.dumps({'who': kernels.WHO, 'file': kernels.__file__,\n"
        "                  'ours': sorted(m for m in sys.modules if 'megalite.kernels' in m)}))",
        PYTHONPATH=str(tmp_path),  # after the working directory, as an installed package is
    )
    assert seen == {"who": "the hub package", "file": str(installed / "__init__.py"), "ours": []}


def test_without_megalite_installed_the_bare_name_is_an_empty_module():
    # -S: no site-packages, so no editable install maps megalite.kernels to the folder
    seen = _run_in_checkout(
        "import json, sys, kernels\n"
        "print(json.dumps({'file': getattr(kernels, '__file__', None), 'attributes':\n"
        "    sorted(a for a in vars(kernels) if not a.startswith('__')),\n"
        "    'modules': sorted(m for m in sys.modules if 'kernels' in m)}))",
        "-S",
    )
    assert seen == {"file": None, "attributes": [], "modules": ["kernels"]}
