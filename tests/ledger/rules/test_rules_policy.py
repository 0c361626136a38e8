"""Policy documents: TOML/YAML/JSON, per-model overrides, errors that name the field."""

from __future__ import annotations

import json

import pytest

from ledger.rules.policy import Policy, PolicyError, load_policy_file, load_policy_text

TOML = """
[rules]
max_output_tokens = 8192
stall_timeout_s = 0          # off
[rules.loop]
min_repeats = 5

[models."llama-3-8b".rules]
max_output_tokens = 1024
loop = { max_period = 16 }

[models."llama-3-8b".slo]
ttft_p99_s = 0.5

[alerts.slo]
ttft_p99_s = 2.0
itl_p99_s = 0.1
"""


def test_toml_policy_merges_model_overrides_over_the_defaults():
    p = load_policy_text(TOML, "toml")
    base, llama = p.rules_for("other"), p.rules_for("llama-3-8b")
    assert base.max_output_tokens == 8192 and base.stall_timeout_s is None
    assert llama.max_output_tokens == 1024
    assert (llama.loop.max_period, llama.loop.min_repeats) == (16, 5)  # nested keys merge, not replace
    assert llama.stall_timeout_s is None
    assert p.slo_for("llama-3-8b").ttft_p99_s == 0.5 and p.slo_for("llama-3-8b").itl_p99_s == 0.1
    assert p.slo_for("other").ttft_p99_s == 2.0


def test_yaml_and_json_files_load_the_same_policy(tmp_path):
    doc = {"rules": {"max_output_tokens": 77, "loop": {"min_span_tokens": 200}}}
    (tmp_path / "p.json").write_text(json.dumps(doc))
    (tmp_path / "p.yaml").write_text("rules:\n  max_output_tokens: 77\n  loop:\n    min_span_tokens: 200\n")
    a, b = load_policy_file(tmp_path / "p.json"), load_policy_file(tmp_path / "p.yaml")
    assert a == b and a.rules.max_output_tokens == 77 and a.rules.loop.min_span_tokens == 200


def test_defaults_are_the_measured_loop_settings():
    rules = Policy().rules
    loop, near = rules.loop, rules.near_loop
    assert (loop.enabled, loop.max_period, loop.min_repeats, loop.min_span_tokens, loop.confirm_tokens) == (
        True,
        512,
        2,
        64,
        16,
    )
    assert (near.enabled, near.min_period, near.max_period, near.min_repeats, near.min_span_tokens) == (
        True,
        4,
        512,
        4,
        768,
    )
    para = rules.paraphrase_loop
    assert para.model_dump() == {
        "enabled": False,
        "ngram": 4,
        "min_seen": 3,
        "window": 256,
        "min_recurrent_ratio": 0.8,
        "min_jumps": 24,
        "min_vocabulary": 64,
    }


def test_near_loop_periods_must_be_ordered_naming_the_field():
    with pytest.raises(PolicyError, match=r"rules\.near_loop\.max_period"):
        load_policy_text("[rules.near_loop]\nmin_period = 64\nmax_period = 8\n", "toml")


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[rules]\nmax_output_tokns = 3", "rules.max_output_tokns"),
        ("[rules.loop]\nmin_repeats = 1", "rules.loop.min_repeats"),
        ('[rules]\npreemption_action = "kill"', "rules.preemption_action"),
        ('[models."m".rules]\nstall_timeout_s = -1', "models.m: stall_timeout_s"),
        ('[models."m".rules]\nloop = { max_period = 0 }', "models.m: loop.max_period"),
        ("[alerts]\nslo_clear_ratio = 1.5", "alerts.slo_clear_ratio"),
        ("rules = [", "not valid toml"),
    ],
)
def test_bad_policy_is_rejected_naming_the_field(text, names):
    with pytest.raises(PolicyError) as err:
        load_policy_text(text, "toml")
    assert names in str(err.value)


def test_missing_policy_file_names_the_path(tmp_path):
    with pytest.raises(PolicyError, match=r"nope\.toml"):
        load_policy_file(tmp_path / "nope.toml")


def test_serve_refuses_a_bad_policy_file_naming_the_field(tmp_path):
    import subprocess
    import sys

    pol = tmp_path / "policy.toml"
    pol.write_text("[rules.loop]\nmin_span_tokens = 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "chunkledger", "serve", "--db", f"duckdb:///{tmp_path}/x.duckdb"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "CHUNKLEDGER_POLICY_FILE": str(pol)},
    )
    assert proc.returncode == 2
    assert "rules.loop.min_span_tokens" in proc.stderr and "policy.toml" in proc.stderr


def test_policy_check_prints_the_effective_policy(tmp_path):
    import subprocess
    import sys

    pol = tmp_path / "p.toml"
    pol.write_text('[models."m".rules]\nmax_output_tokens = 9\n')
    proc = subprocess.run(
        [sys.executable, "-m", "chunkledger", "policy-check", str(pol)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["models"]["m"]["rules"] == {"max_output_tokens": 9}


def test_model_overrides_are_partial_settings_generated_from_the_full_ones():
    from ledger.rules.policy import (
        LoopSettings,
        PartialRuleSettings,
        PartialSloSettings,
        RuleSettings,
        SloSettings,
    )

    for partial, full in [(PartialRuleSettings, RuleSettings), (PartialSloSettings, SloSettings)]:
        assert list(partial.model_fields) == list(full.model_fields)
        for name, f in full.model_fields.items():
            assert partial.model_fields[name].description == f.description
        assert partial().model_dump() == {}  # nothing set: nothing overridden
    nested = PartialRuleSettings.model_fields["loop"].annotation
    assert list(nested.model_fields) == list(LoopSettings.model_fields)
    schema = Policy.model_json_schema()["$defs"]
    assert set(schema["PartialRuleSettings"]["properties"]) == set(RuleSettings.model_fields)
    assert set(schema["PartialSloSettings"]["properties"]) == set(SloSettings.model_fields)
    assert schema["PartialRuleSettings"]["additionalProperties"] is False
    assert "required" not in schema["PartialRuleSettings"]
    assert "default" not in schema["PartialRuleSettings"]["properties"]["max_output_tokens"]


def test_an_override_keeps_only_the_fields_it_sets_and_parses_back_to_itself():
    from ledger.rules.policy import parse_policy, policy_json

    doc = {"models": {"m": {"rules": {"stall_timeout_s": 0, "loop": {"min_repeats": 3}}, "slo": {}}}}
    p = parse_policy(doc)
    dumped = p.model_dump(mode="json")["models"]
    assert dumped == {"m": {"rules": {"stall_timeout_s": None, "loop": {"min_repeats": 3}}, "slo": {}}}
    again = parse_policy(json.loads(policy_json(p)))
    assert again == p and policy_json(again) == policy_json(p)
    rules = again.rules_for("m")
    assert rules.stall_timeout_s is None and rules.loop.min_repeats == 3
    assert rules.loop.max_period == 512 and rules.max_output_tokens == 16384  # the rest: the defaults


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ({"rules": {"max_output_tokenz": 5}}, "models.m: max_output_tokenz: Extra inputs are not permitted"),
        ({"rules": {"loop": {"min_repeatz": 5}}}, "models.m: loop.min_repeatz: Extra inputs"),
        ({"slo": {"ttft_p99": 1.0}}, "models.m: ttft_p99: Extra inputs are not permitted"),
        ({"rulez": {}}, "models.m: rulez: Extra inputs are not permitted"),
        ({"rules": {"preemption_action": None}}, "models.m: preemption_action"),
        ({"rules": {"near_loop": {"max_period": 3}}}, "models.m: near_loop.max_period"),  # < the base's min
    ],
)
def test_an_override_field_that_is_unknown_or_invalid_is_refused_naming_it(override, names):
    from ledger.rules.policy import parse_policy

    with pytest.raises(PolicyError) as err:
        parse_policy({"models": {"m": override}})
    assert names in str(err.value)
