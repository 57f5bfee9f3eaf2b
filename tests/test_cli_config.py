"""The CLI's flags are the config dataclasses' fields: none written apart from a field, every user knob
reachable, the same defaults, and values out of range refused with a message that says what to change."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import typing

import pytest

import stagemesh
from stagemesh import cli
from stagemesh.config_flags import from_args
from stagemesh.launcher import UpConfig
from stagemesh.log import setup_logging
from stagemesh.router.generation import GenerationConfig
from stagemesh.router.priority_queue import AdmissionConfig, ClassLimits
from stagemesh.router.server import RouterConfig
from stagemesh.scheduler.placement import PlacementConfig
from stagemesh.scheduler.scheduler import SchedulerConfig
from stagemesh.stage_server.config import BatcherConfig, StageConfig

COMPOSITION_FLAGS = {
    "--log-level": "every process's logging, set up before its config is built; no service's knob",
    "--log-format": "likewise",
}
"""On `stagemesh` itself, before the subcommand, and on every subcommand (with --config there): no config field."""
SUBCOMMAND_FLAGS = {*COMPOSITION_FLAGS, "--config"}
NOT_KNOBS = {
    "SchedulerConfig.scheduler_id": "the leader lock's holder id, fresh in each process: two schedulers sharing "
                                    "one would both lead",
}
MINIMAL = {
    "stage": ["--model", "m", "--layers", "0:4"],
    "router": ["--model", "m", "--chain", "127.0.0.1:1"],
    "registry": [],
    "scheduler": ["--model", "m"],
    "plan": ["--model", "m"],
    "up": [],
    "roll": ["--mesh", "d"],
    "certs": ["d"],
    "kernels": [],
    "bench": ["--target", "grpc://127.0.0.1:1", "--num-requests", "1"],
}
"""The fewest flags each subcommand builds a valid config from."""


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string but --help and --version; a positional argument (not the subcommand) shows up as its dest."""
    return {s: a for a in parser._actions
            if not isinstance(a, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction)
            for s in a.option_strings or [a.dest]}


def field_flags(cls: type, prefix: str = "", path: tuple = ()) -> tuple[dict[str, list[tuple]], set[str]]:
    """What the fields promise, read here without stagemesh.config_flags: {flag: [field paths]}, and the
    fields marked as no user knob. A nested config's fields are its own; a dict of configs has one set per key."""
    found: dict[str, list[tuple]] = {}
    excluded: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, default = hints[f.name], f.default_factory() if callable(f.default_factory) else f.default
        if "flag" in f.metadata and f.metadata["flag"] is None:
            excluded.add(f"{cls.__name__}.{f.name}")
        elif f.metadata.get("positional"):  # argparse names a positional argument by its dest
            found.setdefault(f.name, []).append((*path, f.name))
        elif dataclasses.is_dataclass(hint):
            sub, sub_excluded = field_flags(hint, prefix, (*path, f.name))
            found.update(sub)
            excluded |= sub_excluded
        elif typing.get_origin(hint) is dict:
            for key in default:
                sub, sub_excluded = field_flags(typing.get_args(hint)[1], f"{prefix}{key}-", (*path, f.name, key))
                found.update(sub)
                excluded |= sub_excluded
        else:
            flag = "--" + prefix + f.metadata.get("flag", f.name.replace("_", "-")).removeprefix("--")
            found.setdefault(flag, []).append((*path, f.name))
            if "deprecated" in f.metadata:  # an old spelling, still accepted
                found.setdefault("--" + prefix + f.metadata["deprecated"].removeprefix("--"), []).append(
                    (*path, f.name))
            if hint is bool and default is True:  # a switch that is on by default is turned off by --no-NAME
                found.setdefault("--no-" + flag.removeprefix("--"), []).append((*path, f.name))
    return found, excluded


def at(config, path: tuple):
    for name in path:
        config = config[name] if isinstance(config, dict) else getattr(config, name)
    return config


def declared_default(cls: type, path: tuple):
    """The default the dataclass declares for the field at path (before __post_init__ fills in, e.g.
    model_name from model); a nested field's default is the one in its parent's default."""
    f = next(f for f in dataclasses.fields(cls) if f.name == path[0])
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return dataclasses.MISSING
    return at(f.default_factory() if callable(f.default_factory) else f.default, path[1:])


def build(command: str, *extra: str):
    args = cli.build_parser().parse_args([command, *MINIMAL[command], *extra])
    return from_args(cli.COMMANDS[command].config, args)


def test_every_flag_is_a_config_field_and_every_knob_has_a_flag():
    parser = cli.build_parser()
    assert set(flags(parser)) - {"--help"} == set(COMPOSITION_FLAGS)
    assert set(subparsers(parser)) == set(cli.COMMANDS)
    all_excluded = set()
    for name, sub in subparsers(parser).items():
        promised, excluded = field_flags(cli.COMMANDS[name].config)
        all_excluded |= excluded
        written = set(flags(sub)) - SUBCOMMAND_FLAGS
        assert written - set(promised) == set(), f"stagemesh {name}: flags that are no config field"
        assert set(promised) - written == set(), f"stagemesh {name}: config fields without a flag"
        for flag, action in flags(sub).items():
            assert action.help and "%" not in action.help.replace("%%", ""), f"stagemesh {name} {flag}: no help"
    assert all_excluded == set(NOT_KNOBS)


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_flag_defaults_are_the_dataclass_defaults(command):
    parsed = build(command)
    required = {"model": "m"} if command in ("stage", "router", "scheduler", "plan") else {}
    required = {"mesh": "d"} if command == "roll" else required
    extra = {"stage": {"layer_start": 0, "layer_end": 4}, "router": {"chains": ["127.0.0.1:1"]},
             "certs": {"directory": "d"}, "bench": {"target": "grpc://127.0.0.1:1", "num_requests": 1}}.get(command, {})
    direct = cli.COMMANDS[command].config(**required, **extra)
    if command == "scheduler":
        direct = dataclasses.replace(direct, scheduler_id=parsed.scheduler_id)
    assert parsed == direct
    promised, _ = field_flags(cli.COMMANDS[command].config)
    for flag, action in flags(subparsers(cli.build_parser())[command]).items():
        if flag in MINIMAL[command] or not action.option_strings or flag in SUBCOMMAND_FLAGS:
            continue  # given, a (required) positional argument, or no config field
        field_default = declared_default(cli.COMMANDS[command].config, promised[flag][0])
        if isinstance(action, argparse._AppendAction):  # argparse would append to a default list
            assert action.default is None and field_default == [], f"stagemesh {command} {flag}"
        else:
            assert action.default == field_default, f"stagemesh {command} {flag}"


BEFORE = {
    "stage": {"--model": None, "--layers": None, "--registry": None, "--model-name": "", "--memory-gb": None,
              "--speed": 1.0, "--host": "127.0.0.1", "--port": 50061, "--device": "auto", "--dtype": "auto",
              "--kv-cache-gb": None, "--session-timeout": 300.0, "--batch-window-ms": 0.0,
              "--max-batch-tokens": None, "--threads": None, "--preload": False, "--quantize": "none"},
    "router": {"--model": None, "--chain": None, "--registry": None, "--model-name": "", "--slots-per-chain": 32,
               "--aging": 10.0, "--wire-dtype": "", "--metrics-port": None, "--host": "127.0.0.1", "--port": 50051,
               "--prefill-chunk": 256},
    "registry": {"--host": "127.0.0.1", "--port": 50050},
    "scheduler": {"--model": None, "--registry": "local", "--host": "127.0.0.1", "--registry-port": 50050,
                  "--model-name": "", "--dtype": "auto", "--quantize": "auto", "--lock-ttl": 3.0,
                  "--kv-headroom": 0.2},
    "plan": {"--model": None, "--registry": "local://127.0.0.1:50050", "--model-name": ""},
    "up": {"--model": None, "--stages": 2, "--replicas": 1, "--port": 50051, "--dtype": "auto",
           "--quantize": "none", "--registry": "local"},
}
"""The flags (and defaults) the hand-written CLI had: README, scripts and tests use them. Changed on purpose
since: --max-batch-tokens 2048 -> by device (256 on a CPU, 2048 on CUDA; stage_server/config.py PASS_TOKENS);
--dtype float32 -> auto everywhere (the checkpoint's, stagemesh/checkpoint.py serving_dtype), the scheduler's
--quantize none -> auto (what the stages announce); the stage's --port 0 -> 50061 (a fixed port a deployment can name;
0 still picks a free one)."""


@pytest.mark.parametrize("command", sorted(BEFORE))
def test_the_flags_written_by_hand_before_keep_their_names_and_defaults(command):
    written = flags(subparsers(cli.build_parser())[command])
    assert {flag: written[flag].default for flag in BEFORE[command] if flag in written} == BEFORE[command]


def test_flags_reach_nested_and_new_knobs():
    stage = build("stage", "--layers", "2:", "--inline-max-ms", "2", "--max-batch-tokens", "64",
                  "--batch-window-ms", "1.5", "--preload", "--session-timeout-s", "9")
    assert (stage.layer_start, stage.layer_end) == (2, None)
    assert stage.batcher == BatcherConfig(batch_window_ms=1.5, max_batch_tokens=64, inline_max_ms=2.0)
    assert stage.preload and stage.session_timeout_s == 9
    router = build("router", "--chain", "127.0.0.1:2", "--max-failovers", "5", "--prefill-chunk", "64",
                   "--batch-max-waiting", "7", "--high-max-wait-s", "1.5", "--aging-s", "3", "--wire-dtype", "int8")
    assert router.chains == ["127.0.0.1:1", "127.0.0.1:2"]
    assert router.generation == GenerationConfig(prefill_chunk=64, max_failovers=5, wire_dtype="int8")
    assert router.admission.aging_s == 3
    assert router.admission.limits["batch"] == ClassLimits(max_waiting=7, max_wait_s=600.0)
    assert router.admission.limits["high"] == ClassLimits(max_waiting=1000, max_wait_s=1.5)
    assert router.admission.limits["normal"] == AdmissionConfig().limits["normal"]
    scheduler = build("scheduler", "--kv-headroom", "0.3", "--max-stages", "2", "--lock-ttl-s", "5")
    assert scheduler.placement == PlacementConfig(kv_headroom_fraction=0.3, max_stages=2)
    assert scheduler.lock_ttl_s == 5
    assert build("up", "--prefill-chunk", "0", "--max-batch-tokens", "128") == UpConfig(prefill_chunk=0,
                                                                                         max_batch_tokens=128)


REFUSED = [
    (["stage", *MINIMAL["stage"], "--speed", "0"], "--speed 0: must be > 0"),
    (["stage", *MINIMAL["stage"], "--speed", "-1.5"], "--speed -1.5: must be > 0"),
    (["stage", *MINIMAL["stage"], "--speed", "nan"], "--speed nan: must be > 0"),
    (["stage", "--model", "m", "--registry", "local://127.0.0.1:1", "--memory-gb", "0"], "--memory-gb 0: must be > 0"),
    (["stage", *MINIMAL["stage"], "--kv-cache-gb", "-1"], "--kv-cache-gb -1: must be > 0"),
    (["stage", *MINIMAL["stage"], "--session-timeout-s", "-5"], "--session-timeout-s -5: must be > 0"),
    (["stage", *MINIMAL["stage"], "--unstepped-session-timeout-s", "0"],
     "--unstepped-session-timeout-s 0: must be > 0"),
    (["stage", *MINIMAL["stage"], "--host", "0.0.0.0"], "--host 0.0.0.0: listens on every interface, which is no "
                                                         "address others can reach; give --advertise HOST[:PORT]"),
    (["stage", *MINIMAL["stage"], "--host", "::"], "--host ::: listens on every interface"),
    (["stage", *MINIMAL["stage"], "--advertise", "0.0.0.0:50061"], "--advertise 0.0.0.0:50061: give the host others"),
    (["stage", *MINIMAL["stage"], "--advertise", "host:0"], "--advertise host:0: port '0' must be 1..65535"),
    (["stage", *MINIMAL["stage"], "--threads", "0"], "--threads 0: must be >= 1"),
    (["stage", *MINIMAL["stage"], "--devices", "0"], "--devices 0: must be >= 1"),
    (["stage", *MINIMAL["stage"], "--port", "65536"], "--port 65536: must be 0..65535"),
    (["stage", *MINIMAL["stage"], "--max-batch-tokens", "0"], "--max-batch-tokens 0: must be >= 1"),
    (["stage", *MINIMAL["stage"], "--batch-window-ms", "-1"], "--batch-window-ms -1: must be >= 0"),
    (["stage", "--model", "m", "--layers", "4:2"], "--layers 4:2: use A:B with 0 <= A < B"),
    (["stage", "--model", "m"], "give --layers A:B, or --registry"),
    (["router", *MINIMAL["router"], "--aging-s", "0"], "--aging-s 0: must be > 0"),
    (["router", *MINIMAL["router"], "--slots-per-chain", "0"], "--slots-per-chain 0: must be >= 1"),
    (["router", *MINIMAL["router"], "--normal-max-waiting", "-1"], "--normal-max-waiting -1: must be >= 0"),
    (["router", *MINIMAL["router"], "--batch-max-wait-s", "-2"], "--batch-max-wait-s -2: must be > 0"),
    (["router", *MINIMAL["router"], "--health-interval-s", "0"], "--health-interval-s 0: must be > 0"),
    (["router", *MINIMAL["router"], "--prefill-chunk", "-1"], "--prefill-chunk -1: must be >= 0"),
    (["router", *MINIMAL["router"], "--long-prompt-tokens", "-1"], "--long-prompt-tokens -1: must be >= 0"),
    (["router", *MINIMAL["router"], "--max-failovers", "-1"], "--max-failovers -1: must be >= 0"),
    (["router", *MINIMAL["router"], "--metrics-port", "99999"], "--metrics-port 99999: must be 0..65535"),
    (["scheduler", "--model", "m", "--lock-ttl-s", "-1"], "--lock-ttl-s -1: must be > 0"),
    (["scheduler", "--model", "m", "--kv-headroom", "1"], "--kv-headroom 1: must be >= 0 and < 1"),
    (["scheduler", "--model", "m", "--max-stages", "0"], "--max-stages 0: must be >= 1"),
    (["scheduler", "--model", "m", "--registry-port", "-1"], "--registry-port -1: must be 0..65535"),
    (["registry", "--port", "70000"], "--port 70000: must be 0..65535"),
    (["up", "--stages", "0"], "--stages 0: must be >= 1"),
    (["up", "--prefill-chunk", "512", "--max-batch-tokens", "256"],
     "--prefill-chunk 512: more than --max-batch-tokens 256, the most a stage runs in one pass"),
    (["up", "--max-batch-tokens", "0"], "--max-batch-tokens 0: must be >= 1"),
    (["up", "--threads", "0"], "--threads 0: must be >= 1"),
    (["up", "--drain-timeout-s", "-1"], "--drain-timeout-s -1: must be >= 0"),
    (["up", "--restart-backoff-s", "0"], "--restart-backoff-s 0: must be > 0"),
    (["up", "--restart-backoff-s", "5", "--restart-backoff-max-s", "1"], "--restart-backoff-max-s 1: must be >= "),
    (["up", "--restart-reset-s", "0"], "--restart-reset-s 0: must be > 0"),
    (["roll", "--mesh", "d", "--timeout-s", "0"], "--timeout-s 0: must be > 0"),
    (["certs", "d", "--days", "0"], "--days 0: must be >= 1"),
    (["router", *MINIMAL["router"], "--public-cert", "c.pem"], "give --public-cert and --public-key together"),
    (["router", *MINIMAL["router"], "--client-ca", "ca.pem"], "--client-ca needs TLS on the public port"),
    (["stage", *MINIMAL["stage"], "--tls", "/nonexistent"], "ca.pem, stage.pem, stage-key.pem missing there"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_out_of_range_values_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stagemesh {argv[0]}: ") and message in err, err


@pytest.mark.parametrize("argv", [["stage", *MINIMAL["stage"], "--speed", "fast"],
                                  ["certs", "d", "--hosts", "bad host!"],
                                  ["stage", "--model", "m", "--layers", "4"],
                                  ["router", *MINIMAL["router"], "--wire-dtype", "int4"],
                                  ["up", "--dtype", "float64"]])
def test_unparsable_values_exit_2_with_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert f"argument {argv[-2]}: " in capsys.readouterr().err  # the last flag given is the bad one


def test_configs_built_directly_check_their_bounds_too():
    with pytest.raises(ValueError, match="--speed 0: must be > 0"):
        StageConfig(model="m", layer_start=0, speed=0)
    with pytest.raises(ValueError, match="--max-batch-tokens 0"):
        BatcherConfig(max_batch_tokens=0)
    with pytest.raises(ValueError, match="--high-max-waiting -1"):
        AdmissionConfig(limits={"high": ClassLimits(max_waiting=-1), "normal": ClassLimits(), "batch": ClassLimits()})
    with pytest.raises(ValueError, match="give one for each of"):
        AdmissionConfig(limits={"high": ClassLimits()})
    with pytest.raises(ValueError, match="--kv-headroom"):
        SchedulerConfig(model="m", placement=PlacementConfig(kv_headroom_fraction=-0.1))
    with pytest.raises(ValueError, match="--wire-dtype 'int4'"):
        RouterConfig(model="m", chains=["127.0.0.1:1"], generation=GenerationConfig(wire_dtype="int4"))
    # A chunk as large as the budget fits a pass; 0 (no chunking) is a deliberate choice: allowed.
    assert UpConfig(prefill_chunk=64, max_batch_tokens=64).prefill_chunk == 64
    assert UpConfig(prefill_chunk=0, max_batch_tokens=64).prefill_chunk == 0


@pytest.mark.parametrize("command", [[], *([name] for name in cli.COMMANDS)])
def test_every_subcommand_says_its_version(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.build_parser().parse_args([*command, "--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"stagemesh {stagemesh.__version__}"


# Configured like a service: a TOML file (--config) and STAGEMESH_<FLAG> variables stand for the flags; flags win
# over the environment, the environment over the file, the file over the defaults.

STAGE_FILE = """
model = "m"
layers = "0:4"
kv_cache_gb = 0.5
session_timeout_s = 60.0
prefix_cache = false

[batcher]
max_batch_tokens = 128
decode_groups = 3
"""


def parsed(argv: list[str], env: dict[str, str], monkeypatch):
    for name in [k for k in os.environ if k.startswith("STAGEMESH_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = cli.parse(argv)
    return from_args(cli.COMMANDS[args.command].config, args)


def test_a_config_file_stands_for_the_flags_it_names(tmp_path, monkeypatch):
    (tmp_path / "stage.toml").write_text(STAGE_FILE)
    from_file = parsed(["stage", "--config", str(tmp_path / "stage.toml")], {}, monkeypatch)
    from_flags = build("stage", "--kv-cache-gb", "0.5", "--session-timeout-s", "60", "--no-prefix-cache",
                       "--max-batch-tokens", "128", "--decode-groups", "3")
    assert from_file == from_flags


def test_environment_variables_stand_for_the_flags_they_name(monkeypatch):
    env = {"STAGEMESH_MODEL": "m", "STAGEMESH_LAYERS": "0:4", "STAGEMESH_KV_CACHE_GB": "0.5",
           "STAGEMESH_PREFIX_CACHE": "false", "STAGEMESH_MAX_BATCH_TOKENS": "128", "STAGEMESH_DTYPE": "bfloat16"}
    from_env = parsed(["stage"], env, monkeypatch)
    assert from_env == build("stage", "--kv-cache-gb", "0.5", "--no-prefix-cache", "--max-batch-tokens", "128",
                             "--dtype", "bfloat16")
    router = parsed(["router", "--model", "m"], {"STAGEMESH_CHAIN": "127.0.0.1:1,127.0.0.1:2 127.0.0.1:3"},
                    monkeypatch)
    assert router.chains == ["127.0.0.1:1,127.0.0.1:2", "127.0.0.1:3"]  # a repeatable flag: items by spaces


def test_a_flag_wins_over_the_environment_which_wins_over_the_file(tmp_path, monkeypatch):
    (tmp_path / "stage.toml").write_text(STAGE_FILE)
    argv = ["stage", "--config", str(tmp_path / "stage.toml")]
    assert parsed(argv, {}, monkeypatch).kv_cache_gb == 0.5
    assert parsed(argv, {"STAGEMESH_KV_CACHE_GB": "2"}, monkeypatch).kv_cache_gb == 2.0
    assert parsed([*argv, "--kv-cache-gb", "3"], {"STAGEMESH_KV_CACHE_GB": "2"}, monkeypatch).kv_cache_gb == 3.0
    assert parsed(argv, {}, monkeypatch).threads is None  # neither: the default


@pytest.mark.parametrize("text,env,says", [
    ('model = "m"\nlayers = "0:4"\nkv_cache_gib = 1\n', {}, "kv_cache_gib: not a setting of this command"),
    ('model = "m"\nlayers = "0:4"\n[batcher]\nmax_tokens = 1\n', {}, "batcher.max_tokens: not a setting"),
    ('model = "m"\nlayers = "0:4"\ndtype = "float64"\n', {}, "dtype = 'float64': use one of auto"),
    ('model = "m"\nlayers = "0:4"\n', {"STAGEMESH_PRELOAD": "maybe"}, "STAGEMESH_PRELOAD='maybe': use one of"),
    ('model = "m"\nlayers = "0:4\n', {}, "not TOML"),
])
def test_a_bad_file_key_or_value_is_refused_by_name(tmp_path, monkeypatch, capsys, text, env, says):
    (tmp_path / "stage.toml").write_text(text)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["stage", "--config", str(tmp_path / "stage.toml")])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("old,new,field,value", [("--session-timeout", "--session-timeout-s", "session_timeout_s", 9.0),
                                                 ("--lock-ttl", "--lock-ttl-s", "lock_ttl_s", 5.0)])
def test_an_old_spelling_still_works_and_says_it_is_deprecated(monkeypatch, capsys, old, new, field, value):
    command = "stage" if "session" in old else "scheduler"
    config = parsed([command, *MINIMAL[command], old, str(value)], {}, monkeypatch)
    assert getattr(config, field) == value
    assert f"{old} is deprecated: use {new}" in capsys.readouterr().err


def test_every_subcommand_takes_its_logging_flags_after_it_too():
    args = cli.build_parser().parse_args(["stage", *MINIMAL["stage"], "--log-level", "debug", "--log-format", "text"])
    assert (args.log_level, args.log_format) == ("debug", "text")
    before = cli.build_parser().parse_args(["--log-format", "text", "router", *MINIMAL["router"]])
    assert (before.log_level, before.log_format) == ("info", "text")


def test_text_logs_are_lines_a_person_reads_with_the_requests_fields(capsys):
    setup_logging("info", "text")
    try:
        logging.getLogger("stagemesh.router").info("served", extra={"request_id": "r-1", "chain": "c"})
        logging.getLogger("stagemesh.router").debug("not shown at info")
    finally:
        setup_logging("info", "json")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].endswith("info    stagemesh.router: served  request_id=r-1 chain=c"), lines
