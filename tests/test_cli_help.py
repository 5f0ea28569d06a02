"""The command line documents itself: each subcommand's --help has a description and an example that parses,
every option has help text, and `jaxformer config` lists every field of the config with overrides applied."""

import argparse
import dataclasses
import shlex

from jaxformer import cli, config


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_every_subcommand_has_a_description_an_example_and_option_help():
    parser = cli.build_parser()
    for name, command in _subcommands().items():
        text = command.format_help()
        assert command.description and command.description.strip(), f"jaxformer {name}: no description"
        assert f"example:\n  jaxformer {name}" in text, f"jaxformer {name} --help shows no example (cli.EXAMPLES)"
        example = shlex.split(cli.EXAMPLES[name])
        assert parser.parse_args(example[1:]).command == name, f"the example of {name} does not parse"
        for action in command._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            label = "/".join(action.option_strings) or action.dest
            assert action.help and action.help.strip(), f"jaxformer {name} {label}: no help text"


def _dotted_fields(section, prefix: str) -> dict[str, object]:
    """section.field -> value for every field, nested sections (model.moe) walked: the dataclasses themselves."""
    out = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            out |= _dotted_fields(value, f"{prefix}.{f.name}")
        else:
            out[f"{prefix}.{f.name}"] = value
    return out


def test_config_command_lists_every_field_with_overrides(capsys):
    experiment = "experiments/lm_shakespeare.py"
    assert cli.main(["config", experiment, "--set", "train.steps=5", "--set", "model.moe.num_experts=4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    cfg = config.load_experiment(experiment)
    assert cfg.train.steps != 5 and cfg.model.moe.num_experts != 4  # the overrides change something
    expected = {}
    for name in config.SECTIONS:
        expected |= _dotted_fields(getattr(cfg, name), name)
    expected |= {"train.steps": 5, "model.moe.num_experts": 4}
    shown = {}
    for line in lines:
        if " = " in line and not line.startswith("["):
            left, comment = line.split("  # ", 1)
            name, value = left.split(" = ", 1)
            annotation, _, meaning = comment.partition(": ")
            assert annotation.strip() and meaning.strip(), f"{name}: no type or meaning shown"
            shown[name] = value.strip()
    assert sorted(shown) == sorted(expected), "jaxformer config does not list exactly the config's fields"
    for name, value in expected.items():
        if isinstance(value, (int, float, str)):  # (tuples and None as --set takes them: "a,b", "none")
            assert shown[name] == str(value), f"{name}: shows {shown[name]}, the config holds {value!r}"
