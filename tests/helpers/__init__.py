"""What the tests share: the single-process oracle, the routing cases, the multi-process launcher,
the background compile jobs, the graph normaliser, the harness's own knobs, the repo's root and
a loader for the scripts of `dev/`."""

import importlib.util
import os

#: The repository's root (the checkout the tests run from).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_dev_script(name: str):
    """The script `dev/<name>.py` as a module (`name` may hold a folder, e.g. "gpu/x"; dev/ is
    no package)."""
    spec = importlib.util.spec_from_file_location(
        "_dev_" + name.replace("/", "_"), os.path.join(REPO_ROOT, "dev", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_dev_gpu_script(name: str):
    """The script `dev/gpu/<name>.py` as a module."""
    return load_dev_script(f"gpu/{name}")
