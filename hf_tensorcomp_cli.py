"""Entry point of the ``hf-tensorcomp`` script: parses the command line without importing hf_tensorcomp.

Importing the ``hf_tensorcomp`` package registers its quantizer with transformers, which imports
torch and transformers (10-30 s on a cold or busy machine). ``hf-tensorcomp --help`` needs neither:
this module loads ``hf_tensorcomp/cli.py`` (standard library only at import) on its own, so help and
usage errors answer at once; the package is imported when a command runs.
"""

from __future__ import annotations

import importlib.util
import sys


def _cli():
    if "hf_tensorcomp.cli" in sys.modules:
        return sys.modules["hf_tensorcomp.cli"]
    package = importlib.util.find_spec("hf_tensorcomp")  # finds the package without running its __init__
    spec = importlib.util.spec_from_file_location("hf_tensorcomp.cli", package.submodule_search_locations[0] + "/cli.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the package's own `import hf_tensorcomp.cli` later finds this one
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    return _cli().main(argv)


if __name__ == "__main__":
    sys.exit(main())
