"""What the tests share: the single-process oracle, the routing cases, the multi-process launcher,
the background compile jobs, the graph normaliser, the harness's own knobs, the repo's root and
a loader for the scripts of `dev/`."""

import importlib.util
import logging
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


def process_failure(done, tail: int = 3000) -> str:
    """What a failed subprocess said, for an assertion message: stdout's tail, the first
    Python traceback in stderr (a child's own error, which torchrun's closing report would push
    out of a bare tail) and stderr's tail."""
    stderr = done.stderr or ""
    first = stderr.find("Traceback (most recent call last)")
    traceback = stderr[first:first + tail] if first >= 0 else ""
    return "\n".join(part for part in (
        "stdout: " + (done.stdout or "")[-tail:],
        "first traceback: " + traceback if traceback else "",
        "stderr: " + stderr[-tail:]) if part)


class WarningCapture(logging.Handler):
    """The messages of WARNING and above that a logger hands this handler (after the logger's
    filters): add it to the logger itself, since a library may stop its loggers' propagation."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())
