"""Print one of the README's set-up commands: `main` (the paragraph that starts "Run the
main job") or `tests` ("Run the tests"): the first ```bash block after it."""

import re
import sys
from pathlib import Path

LEADS = {"main": "Run the main job", "tests": "Run the tests"}

text = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
lead = LEADS[sys.argv[1]]
match = re.search(re.escape(lead) + r".*?```bash\n(.*?)\n```", text, re.S)
if match is None:
    sys.exit(f"README.md has no ```bash block after {lead!r}")
print(match.group(1).strip())
