"""What the tests share: the single-process oracle, the routing cases, the multi-process launcher,
the background compile jobs, the graph normaliser, the harness's own knobs and the repo's root."""

import os

#: The repository's root (the checkout the tests run from).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
