"""loadtest/aiperf_payload.json, the body aiperf's template endpoint sends (docs/benchmarking.md):
rendered as aiperf renders it (Jinja2 with autoescape), it is JSON whose fields are
ensemble inputs of the right types, whatever the prompt holds."""

import json
import re
from pathlib import Path

import jinja2

from specdec import tensor_names as tn

ROOT = Path(__file__).resolve().parents[2]


def test_the_payload_renders_to_ensemble_inputs_for_any_prompt():
    template = jinja2.Environment(autoescape=True).from_string((ROOT / "loadtest" / "aiperf_payload.json").read_text())
    prompt = 'He said "stop", then left\\n\n<b>&</b> ü 🚀 {"x": 1}'
    body = json.loads(template.render(text=prompt, max_tokens=64))
    assert body == {tn.TEXT_INPUT: prompt, tn.MAX_TOKENS: 64, tn.STREAM: True, tn.IGNORE_EOS: True}
    declared = re.findall(r'name: "(\w+)"', (ROOT / "model_repository" / "ensemble" / "config.pbtxt").read_text())
    assert set(body) <= set(declared)
