"""Bundled data: the Azure traces and length tables ship with the package, named in NOTICE.md."""

import json

import pytest

from sim.commands.main import main
from traces.bundled import LENGTH_TABLES, TRACES, data_dir, data_path, resolve_trace
from traces.loaders import load_trace


def test_every_bundled_file_is_present_and_credited():
    notice = (data_dir() / "NOTICE.md").read_text()
    for name in TRACES + LENGTH_TABLES:
        assert data_path(name).is_file(), name
        assert f"`{name}`" in notice
    assert "CC-BY 4.0" in notice and "Azure LLM inference trace 2023" in notice


def test_unknown_bundled_name_is_refused_with_the_list():
    with pytest.raises(ValueError, match="azure-llm-2023-conv.csv"):
        data_path("azure-llm-2099.csv")


def test_a_bare_bundled_name_resolves_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_trace("azure-llm-2023-conv.csv") == data_path("azure-llm-2023-conv.csv")
    assert resolve_trace("azure-llm-2023-code") == data_path("azure-llm-2023-code.csv")
    trace, report = load_trace("azure-llm-2023-code.csv")
    assert report.format == "azure" and len(trace) == 8819


def test_an_existing_file_or_a_path_with_a_folder_is_never_redirected(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "azure-llm-2023-conv.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    trace, _ = load_trace("azure-llm-2023-conv.csv")
    assert len(trace) == 1                                   # the user's file, not ours
    with pytest.raises(FileNotFoundError, match="no such trace file"):
        load_trace("runs/azure-llm-2023-code.csv")
    with pytest.raises(FileNotFoundError, match="no such trace file"):
        load_trace("sharegpt-chatbot-lengths.csv")           # a length table is not a trace


def test_the_readme_tour_trace_command_runs_from_a_fresh_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--trace", "azure-llm-2023-conv.csv", "--num-requests", "300",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_requests"] == 300
