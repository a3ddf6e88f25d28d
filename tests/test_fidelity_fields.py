"""The importers' shared reads of request bodies and JSON-lines files (fidelity/fields.py)."""

from __future__ import annotations

import pytest

from servelab.common.errors import InputError
from servelab.fidelity.fields import json_body, json_lines, prompt_text


def test_prompt_text_reads_chat_parts_completions_and_extra_values():
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image_url"}]}]}
    assert prompt_text(chat) == "be brief\nhello"
    assert prompt_text({"prompt": ["a", "b"]}) == "a\nb"
    assert prompt_text({"text_input": "t"}, "beside") == "t\nbeside"
    assert prompt_text({}) is None


def test_json_body_parses_text_and_names_field_and_row(tmp_path):
    path = tmp_path / "r.json"
    assert json_body(path, '{"model": "m"}', "request", 3) == {"model": "m"}
    assert json_body(path, None, "request", 3) == {}
    with pytest.raises(InputError, match=r"r.json.*row 3.*request.*not JSON|r.json.*request.*row 3.*not JSON"):
        json_body(path, "{", "request", 3)


def test_json_lines_skips_blank_lines_and_names_the_bad_row(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert json_lines(path, "record") == [(1, {"a": 1}), (3, {"a": 2})]
    path.write_text('{"a": 1}\n[1]\n')
    with pytest.raises(InputError, match="row 2.*one record"):
        json_lines(path, "record")
