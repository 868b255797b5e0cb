"""How commands print a user error: exit code 2 and the message as written."""

from __future__ import annotations

import yaml
from factories import model_entry
from typer.testing import CliRunner

from fleetserve.cli.main import app


def test_a_config_error_naming_a_model_in_brackets_prints_it_whole(tmp_path):
    path = tmp_path / "platform.yaml"
    path.write_text(yaml.safe_dump({"models": [{**model_entry("tiny"), "engine_args": {"max_num_seqs": 4}}],
                                    "limits": {"num_reserved_slots": 4}}))
    result = CliRunner().invoke(app, ["plan", str(path)])
    # Before, rich read "[tiny]" as markup and printed "models's max_num_seqs".
    assert result.exit_code == 2
    assert "limits.num_reserved_slots (4) must be below models[tiny]'s max_num_seqs (4)" in " ".join(
        result.stderr.split())


def test_ctrl_c_while_apply_waits_says_the_change_goes_on(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from fleetserve.deployments import apply, local_run

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(local_run, "join_cluster", lambda address: None)
    monkeypatch.setattr(apply, "plan_change", lambda config: SimpleNamespace(is_empty=False, describe=lambda: []))
    monkeypatch.setattr(apply, "apply_config", interrupted)
    config = tmp_path / "platform.yaml"
    config.write_text(yaml.safe_dump({"models": [model_entry()]}))
    result = CliRunner().invoke(app, ["apply", str(config), "--no-placement-check"])
    # Before: click's "Aborted!", though Serve went on rolling the change out.
    assert result.exit_code == 130
    assert "A change Serve had been sent goes on rolling out" in " ".join(result.output.split())
