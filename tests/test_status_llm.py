"""With an `llm:` section the status document counts generated tokens and shows the LLM experts' residency."""
from __future__ import annotations

import http.client
import json
import shutil
import urllib.request

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from moe_models import build  # noqa: E402

from conftest import write_line  # noqa: E402
from edge_agent.agent import Agent  # noqa: E402
from edge_agent.config import load_config  # noqa: E402
from edge_agent.llm_models import byte_tokenizer  # noqa: E402
from storage.llm_import import import_checkpoint  # noqa: E402


def test_tokens_and_llm_residency_reach_the_status_document(tmp_path, tiny_zoo):
    build("mixtral", tmp_path / "hf", seed=3)
    byte_tokenizer().save_pretrained(tmp_path / "hf")
    import_checkpoint(tmp_path / "hf", tmp_path / "llm", name="tiny")
    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    cfg = load_config(write_line(tmp_path / "line", store=store, llm={"store": str(tmp_path / "llm"), "port": 0}),
                      env={})
    agent = Agent(cfg).start()
    try:
        con = http.client.HTTPConnection("127.0.0.1", agent.llm.port, timeout=60)
        con.request("POST", "/v1/completions", body=json.dumps({"prompt": "def main(", "max_tokens": 6}),
                    headers={"Content-Type": "application/json"})
        usage = json.loads(con.getresponse().read())["usage"]
        con.close()
        agent.status.tick()
        doc = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/api/status", timeout=10).read())
        llm = doc["llm"]
        assert llm["model"] == "tiny" and llm["tokens"] == usage["completion_tokens"] > 0
        assert llm["experts"] == len(agent.llm_layout.ids()) and 0 < llm["resident"] <= llm["experts"]
        pool = next(p for p in doc["pools"] if p["name"] == agent.llm_slot.name)
        flagged = {r["expert_id"] for r in pool["residents"] if r["llm"]}
        assert flagged and flagged <= set(agent.llm_layout.ids()) and len(flagged) == llm["resident"]
        assert not any(r["llm"] for r in pool["residents"] if r["expert_id"] in agent.model.experts)
    finally:
        agent.stop()
