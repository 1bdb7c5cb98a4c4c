"""`voxgate serve --config voxgate.toml`: the file sets serve flags, the command line overrides it, unknown keys and
values of the wrong kind are clear errors, and the shipped deploy/voxgate.toml names every serve flag. (A served
node started from a config file is in tests/test_cluster_haproxy.py.)"""

import re
from pathlib import Path

import pytest

from gateway.cli import _parser, main
from gateway.config_file import settable_flags, subparser, with_config_file

SAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "voxgate.toml"


def _parse(argv: list[str], path: Path):
    parser = _parser()
    return parser.parse_args(with_config_file(parser, argv, path))


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:  # argparse's own errors exit with status 2
        code = main(argv)
        raise SystemExit(code)
    return exited.value.code, capsys.readouterr().err


def test_the_file_sets_flags_and_the_command_line_overrides_it(tmp_path):
    path = tmp_path / "voxgate.toml"
    path.write_text('max-sessions = 7\nidle_timeout = 5.5\nfp8-prefill = true\nno-merge-lora = false\n'
                    'host = "127.0.0.1"\nport = 9000\nvae-dtype = "bfloat16"\ndevices = "cpu,cpu"\n')
    args = _parse(["serve", "--config", str(path)], path)
    assert (args.max_sessions, args.idle_timeout, args.fp8_prefill, args.no_merge_lora) == (7, 5.5, True, False)
    assert (args.host, args.port, args.vae_dtype, args.devices) == ("127.0.0.1", 9000, "bfloat16", "cpu,cpu")
    args = _parse(["serve", "--config", str(path), "--port", "9001", "--max-sessions", "8"], path)
    assert (args.port, args.max_sessions, args.idle_timeout) == (9001, 8, 5.5)
    defaults = _parser().parse_args(["serve"])
    assert args.max_sessions_per_key == defaults.max_sessions_per_key  # what the file leaves out keeps its default


@pytest.mark.parametrize(("content", "message"), [
    ("max-session = 7\n", "unknown setting 'max-session'"),
    ("[serve]\nport = 1\n", "unknown setting 'serve'"),
    ("config = 'other.toml'\n", "unknown setting 'config'"),
    ("fp8-prefill = 'yes'\n", "fp8-prefill is a switch: true or false"),
    ("port = true\n", "port takes one value"),
    ("devices = [0, 1]\n", "devices takes one value"),
    ("port = \n", "not valid TOML"),
])
def test_bad_files_are_one_line_errors(tmp_path, capsys, content, message):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    code, err = _run(capsys, ["serve", "--config", str(path)])
    assert code == 2 and message in err and str(path) in err and "Traceback" not in err


def test_values_are_checked_by_the_flags_own_definitions(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text('max-sessions = "many"\n')
    code, err = _run(capsys, ["serve", "--config", str(path)])
    assert code == 2 and "--max-sessions" in err and "invalid int value: 'many'" in err
    path.write_text('vae-dtype = "float8"\n')
    code, err = _run(capsys, ["serve", "--config", str(path)])
    assert code == 2 and "--vae-dtype" in err and "invalid choice" in err


def test_a_missing_file_is_a_one_line_error(tmp_path, capsys):
    code, err = _run(capsys, ["serve", "--config", str(tmp_path / "nowhere.toml")])
    assert code == 2 and "cannot read" in err and "nowhere.toml" in err and "Traceback" not in err


def test_the_sample_names_every_serve_flag_and_each_parses():
    text = SAMPLE.read_text()
    keys = set(re.findall(r"(?m)^#?\s*([a-z][a-z0-9-]*)\s*=", text))
    flags = set(settable_flags(subparser(_parser(), "serve")))
    assert not flags - keys, f"deploy/voxgate.toml does not list: {sorted(flags - keys)}"
    assert not keys - flags, f"deploy/voxgate.toml names what is no serve flag: {sorted(keys - flags)}"
    args = _parse(["serve", "--config", str(SAMPLE)], SAMPLE)
    assert args.port == 8080 and args.max_sessions == 1000


def test_every_commented_setting_of_the_sample_parses(tmp_path):
    every = tmp_path / "every.toml"
    every.write_text(re.sub(r"(?m)^#\s*([a-z][a-z0-9-]*\s*=)", r"\1", SAMPLE.read_text()))
    args = _parse(["serve", "--config", str(every)], every)
    assert args.model == "openbmb/VoxCPM2" and args.api_keys_file == "/etc/voxgate/api-keys"
    assert args.devices == "0,1" and args.max_num_seqs == 256 and args.vae_dtype == "float32"
