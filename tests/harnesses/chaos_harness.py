"""A harness that misbehaves when its task says so, and otherwise is the vowels example harness.

task.data.behaviour: "crash" (exit 3 after one model call), "hang" (sleep past any timeout), "noreward"
(talk to the model, exit 0 without a reward); anything else runs examples/vowels/harness.py unchanged.
"""

import json
import os
import runpy
import sys
import time
from pathlib import Path

from openai import OpenAI

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vowels" / "harness.py"

task = json.loads(Path(os.environ["HARNESSRL_TASK_FILE"]).read_text())
behaviour = task.get("data", {}).get("behaviour")
if behaviour == "hang":
    time.sleep(3600)
if behaviour in ("crash", "noreward"):
    client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key="unused")
    client.chat.completions.create(model=os.environ["HARNESSRL_MODEL_NAME"], max_tokens=8,
                                   messages=[{"role": "user", "content": "hello"}])
    if behaviour == "crash":
        print("chaos harness: crashing on purpose", file=sys.stderr)
        sys.exit(3)
    sys.exit(0)
sys.argv = [str(EXAMPLE)]
runpy.run_path(str(EXAMPLE), run_name="__main__")
