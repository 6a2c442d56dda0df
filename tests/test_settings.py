"""Every setting declared once: its flag and VIT22B_ variable are generated, the flag wins,
bad values are refused naming the flag."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from vit22b.clients import settings
from vit22b.model.outputs import OutputRequest
from vit22b.server.distributed_cli import GroupSettings
from vit22b.server.settings import ServeConfig


def parse(argv: list[str], environ: dict[str, str]) -> ServeConfig:
    parser = argparse.ArgumentParser(exit_on_error=False)
    settings.add_arguments(parser, ServeConfig, environ)
    return settings.from_args(ServeConfig, parser.parse_args(argv))


def test_every_serve_setting_has_a_flag_and_a_variable():
    rows = settings.describe(ServeConfig)
    declared = [f.name for f in dataclasses.fields(ServeConfig) if f.metadata.get("cli")]
    assert len(rows) == len(declared) >= 20
    for flag, env, _, help_ in rows:
        assert flag.startswith("--") and env == "VIT22B_" + flag[2:].replace("-", "_").upper()
        assert help_
    assert ("--drain-timeout", "VIT22B_DRAIN_TIMEOUT") in {(f, e) for f, e, _, _ in rows}
    assert {f for f, _, _, _ in settings.describe(GroupSettings)} == {
        "--coordinator", "--num-processes", "--process-id", "--init-timeout", "--peer-timeout"}


def test_variables_set_defaults_and_flags_win():
    env = {"VIT22B_MAX_BATCH_IMAGES": "16", "VIT22B_METRICS_PORT": "-1",
           "VIT22B_WARM_OUTPUTS": "pooled;pooled+patch:-1,-2", "VIT22B_COMPUTE_DTYPE": "float32"}
    config = parse([], env)
    assert config.max_batch_images == 16 and config.metrics_port is None
    assert config.compute_dtype == "float32"
    assert [o.patch_layers for o in config.warm_outputs] == [(), (-1, -2)]
    config = parse(["--max-batch-images", "8", "--warm-outputs", "class_token"], env)
    assert config.max_batch_images == 8 and len(config.warm_outputs) == 1
    # every output kind, spelled as a request spells it (register_tokens, pre_projection and
    # patch_tokens were "unknown output": DINOv3's or CLIP's sets could not be warmed)
    config = parse(["--warm-outputs", "pooled+register_tokens+pre_projection",
                    "--warm-outputs", "patch_tokens+norm_patches"], {})
    assert config.warm_outputs == (
        OutputRequest.of(["pooled", "register_tokens", "pre_projection"]),
        OutputRequest.of(["patch_tokens"], norm_patches=True))
    assert parse([], {}).max_batch_images == 32  # the declared default


def test_bad_values_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--max-queue-images must be positive"):
        parse(["--max-queue-images", "0"], {}).check()
    # a variable's value out of range names the variable the user set, and its flag
    with pytest.raises(ValueError,
                       match=r"^\$VIT22B_CHUNK_IMAGES='-3': --chunk-images must be >= 0"):
        parse([], {"VIT22B_CHUNK_IMAGES": "-3"})
    with pytest.raises(ValueError, match=r"^\$VIT22B_GRPC_MESSAGE_TIMEOUT='0': "
                       "--grpc-message-timeout must be positive, got 0.0"):
        parse([], {"VIT22B_GRPC_MESSAGE_TIMEOUT": "0"})
    assert parse([], {"VIT22B_GRPC_MESSAGE_TIMEOUT": "2.5"}).grpc_message_timeout_s == 2.5
    # a bad variable is refused naming it (it was a flag's error, or, for a repeatable
    # setting, a traceback while the parser was built: `vit22b serve --help` included)
    with pytest.raises(ValueError, match=r"^\$VIT22B_COMPUTE_DTYPE='float8': --compute-dtype "):
        parse([], {"VIT22B_COMPUTE_DTYPE": "float8"})
    with pytest.raises(ValueError, match=r"^\$VIT22B_WARM_OUTPUTS='patch:;pooled': bad layer"):
        parse([], {"VIT22B_WARM_OUTPUTS": "patch:;pooled"})
    with pytest.raises(ValueError, match=r"^\$VIT22B_HTTP_CORS_ALLOW_ORIGIN='not-an-origin'"):
        parse([], {"VIT22B_HTTP_CORS_ALLOW_ORIGIN": "not-an-origin"})
    assert parse(["--warm-outputs", "pooled"], {"VIT22B_WARM_OUTPUTS": "patch:"}).warm_outputs
    for spec, message in (("", "an empty output in ''"), ("pooled++patch:1", "an empty output"),
                          ("patch:1_0", "bad layer list"), ("patch:\uff11", "bad layer list")):
        with pytest.raises(argparse.ArgumentError, match=message):  # were pooled, layers 10, 1
            parse(["--warm-outputs", spec], {})
    with pytest.raises(SystemExit) as shown:
        parse(["--help"], {"VIT22B_WARM_OUTPUTS": "patch:", "VIT22B_SEED": "x"})
    assert shown.value.code == 0
    with pytest.raises(argparse.ArgumentError, match="normalize_patches applies to patch"):
        parse(["--warm-outputs", "pooled+norm_patches"], {})  # a warm forward of no use
    with pytest.raises(ValueError, match="--port must be 0..65535, got 99999"):
        parse(["--port", "99999"], {}).check()
    with pytest.raises(ValueError, match="--http-port must be 0..65535, got 70000"):
        parse([], {"VIT22B_HTTP_PORT": "70000"})
    with pytest.raises(ValueError, match="--http-header-timeout must be positive, got 0.0"):
        parse(["--http-header-timeout", "0"], {}).check()
    with pytest.raises(ValueError, match="--http-max-connections must be positive, got -1"):
        parse([], {"VIT22B_HTTP_MAX_CONNECTIONS": "-1"})



def test_numbers_are_read_as_a_person_writes_them(capsys):
    """Python's int() and float() read "1_0" as 10 and a full-width "\uff11" as 1: a typo or a
    pasted value became a setting nobody meant. Every number of every command is plain digits."""
    from vit22b.clients.cli import main
    from vit22b.model.schema import real_number, whole_number

    for text, value in (("16", 16), (" 16 ", 16), ("+3", 3), ("-1", -1)):
        assert whole_number(text) == value
    for text, value in (("2.5", 2.5), ("2e1", 20.0), (".5", 0.5), ("3.", 3.0), ("-1E-3", -1e-3)):
        assert real_number(text) == value
    for text in ("1_0", "\uff11", "\u00b2", "0x10", "1.5", "", "ten"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number"):
            whole_number(text)
    for text in ("1_0.5", "\uff11", "1,5", "0x1p3", "", "e3", "1e"):
        with pytest.raises(ValueError, match="expected a number"):
            real_number(text)
    assert real_number("inf") == float("inf")  # read, then refused by the setting's own rule
    with pytest.raises(argparse.ArgumentError, match="expected a whole number .*'1_0'"):
        parse(["--max-batch-images", "1_0"], {})
    with pytest.raises(argparse.ArgumentError, match="expected a number .*'\uff11'"):
        parse(["--max-delay-ms", "\uff11"], {})
    with pytest.raises(ValueError, match=r"^\$VIT22B_PORT='8_000': expected a whole number"):
        parse([], {"VIT22B_PORT": "8_000"})
    with pytest.raises(argparse.ArgumentError, match="bad list of sizes"):
        parse(["--resolutions", "2_24"], {})
    with pytest.raises(ValueError, match="must be a finite number"):
        parse(["--drain-timeout", "inf"], {}).check()
    # the other commands' own numbers: a job's layers, a probe's counts, the converter's sizes
    for argv, message in ((["embed", "x", "-o", "y", "--layers", "1_0"], "want integers"),
                          (["probe", "linear", "--shapes-world", "1_0"], "expected a whole"),
                          (["probe", "linear", "--digits", "--temperature", "1_0"],
                           "expected positive values: expected a number (plain digits"),
                          (["convert", "x", "--from", "timm", "-o", "y", "--crop", "2_24"],
                           "expected a whole number")):
        with pytest.raises(SystemExit) as ended:
            main(argv)
        assert ended.value.code == 2, argv
        assert message in capsys.readouterr().err, argv


def test_cors_origins_are_origins_or_refused():
    """An origin with a path or a trailing slash never equals a browser's Origin header: the
    page's every call would fail in the browser, with nothing in the server's log."""
    env = {"VIT22B_HTTP_CORS_ALLOW_ORIGIN": "https://app.example;http://localhost:3000"}
    assert parse([], env).http_cors_allow_origin == ("https://app.example",
                                                     "http://localhost:3000")
    assert parse(["--http-cors-allow-origin", "*"], env).http_cors_allow_origin == ("*",)
    assert parse([], {}).http_cors_allow_origin == ()
    for bad in ("https://app.example/", "app.example", "ftp://app.example",
                "https://app.example/page", "https://", "https://*.example"):
        with pytest.raises(argparse.ArgumentError, match="an origin is scheme://host"):
            parse(["--http-cors-allow-origin", bad], {})


@pytest.mark.parametrize(("endpoint", "message"), [
    # no scheme: the exporter took TLS to a plaintext collector and exported nothing, silently
    ("127.0.0.1:4317", "must name http:// \\(plaintext\\) or https:// \\(TLS\\) and a host"),
    ("http://", "must name http://"),
    ("ftp://127.0.0.1:4317", "must name http://"),
    ("http://[::1", "is not a URL \\(Invalid IPv6 URL\\)"),  # was "Invalid IPv6 URL" alone
    ("http://127.0.0.1:99999", "is not a URL \\(Port out of range"),
    ("http://127.0.0.1:4317/v1/traces", "takes no path"),  # OTLP/HTTP's path, dropped
    ("http://127.0.0.1:0", "names port 0"),
    (" ", "must be a URL"),
    ("http://" + "a" * 3000, "must be a URL"),
])
def test_an_otlp_endpoint_that_cannot_be_a_collector_is_refused(endpoint, message):
    with pytest.raises(ValueError, match="--otlp-endpoint " + message):
        parse(["--otlp-endpoint", endpoint], {}).check()
    for good in ("http://127.0.0.1:4317", "https://collector.example:4317/", "http://[::1]:4317"):
        parse(["--otlp-endpoint", good], {}).check()


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-delay-ms", "inf"], "--max-delay-ms must be a finite number, got inf"),
    (["--max-delay-ms", "nan"], "--max-delay-ms must be a finite number, got nan"),
    # a wait the batcher's clock cannot hold: its thread died, and every call then timed out
    (["--max-delay-ms", "1e300"], "--max-delay-ms must be at most 60000"),
    (["--max-message-mb", "inf"], "--max-message-mb must be a finite number"),  # was a traceback
    (["--max-message-mb", "4096"], "--max-message-mb must be at most 2047"),
    (["--drain-timeout", "inf"], "--drain-timeout must be a finite number"),
    (["--drain-timeout", "1e12"], "--drain-timeout must be at most 86400"),
    (["--http-header-timeout", "1e9"], "--http-header-timeout must be at most 3600"),
    (["--http-body-timeout=-inf"], "--http-body-timeout must be a finite number"),
    # its bytes overflowed an integer after the model was built: a traceback
    (["--max-unread-mb", "1e308"], "--max-unread-mb must be at most 1e\\+09"),
    (["--max-unread-mb", "0"], "--max-unread-mb must be positive"),
])
def test_infinite_or_absurd_times_and_sizes_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(argv, {}).check()


def test_the_bounds_themselves_are_accepted():
    config = parse(["--max-delay-ms", "60000", "--max-message-mb", "2047", "--drain-timeout",
                    "86400", "--http-header-timeout", "3600", "--max-delay-ms", "0",
                    "--max-unread-mb", "1e9"], {})
    config.check()
    group = GroupSettings(init_timeout=86400, peer_timeout=3600.0)
    settings.check(group)
    with pytest.raises(ValueError, match="--peer-timeout must be a finite number"):
        settings.check(dataclasses.replace(group, peer_timeout=float("inf")))
    with pytest.raises(ValueError, match="--init-timeout must be at most 86400"):
        settings.check(dataclasses.replace(group, init_timeout=10**9))

def test_compute_dtype_defaults_to_auto_for_serving_and_local_jobs():
    from vit22b.clients.embed_cli import EmbedSettings

    assert parse([], {}).compute_dtype == "auto"
    assert parse(["--compute-dtype", "none"], {}).compute_dtype is None  # the model's, anywhere
    assert parse(["--compute-dtype", "bfloat16"], {}).compute_dtype == "bfloat16"
    parser = argparse.ArgumentParser(exit_on_error=False)
    settings.add_arguments(parser, EmbedSettings, {"VIT22B_COMPUTE_DTYPE": "float32"})
    assert settings.from_args(EmbedSettings, parser.parse_args([])).compute_dtype == "float32"
    parser = argparse.ArgumentParser(exit_on_error=False)
    settings.add_arguments(parser, EmbedSettings, {})
    assert settings.from_args(EmbedSettings, parser.parse_args([])).compute_dtype == "auto"


def test_http_client_bounds_are_settings():
    config = parse(["--http-body-timeout", "2.5"], {"VIT22B_HTTP_HEADER_TIMEOUT": "3",
                                                    "VIT22B_HTTP_BODY_TIMEOUT": "9"})
    assert (config.http_header_timeout_s, config.http_body_timeout_s) == (3.0, 2.5)
    assert parse(["--http-max-connections", "7"], {}).http_max_connections == 7
    assert parse([], {}).http_min_body_rate == 16384
    assert parse([], {"VIT22B_HTTP_MIN_BODY_RATE": "0"}).http_min_body_rate == 0  # no floor


def test_the_connection_cap_defaults_to_half_the_open_file_limit():
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limits = {1000: 500, 10000: 4096}  # at most 4096
    try:
        for limit, cap in limits.items():
            if hard != resource.RLIM_INFINITY and limit > hard:
                continue
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
            assert parse([], {}).http_max_connections == cap
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_embed_options_are_declared_settings_too():
    from vit22b.clients.embed_cli import EmbedSettings, output_spec

    parser = argparse.ArgumentParser(exit_on_error=False)
    settings.add_arguments(parser, EmbedSettings, {"VIT22B_SERVER": "h1:1;h2:2",
                                                   "VIT22B_LAYERS": "-1,2"})
    options = settings.from_args(EmbedSettings, parser.parse_args(["--tls", "-q"]))
    assert options.server == ("h1:1", "h2:2") and options.tls is True and options.quiet is True
    spec = output_spec(options)  # layers imply patch tokens: the one definition of defaults
    assert spec.pooled and spec.patch_layers == (-1, 2)
    with pytest.raises(ValueError, match="--batch-size must be positive"):
        settings.check(settings.from_args(EmbedSettings, parser.parse_args(["--batch-size", "0"])))
    # an outside tester's 2,000,000 ran 28 images in 220 s and 5.5 GB
    with pytest.raises(ValueError, match="--concurrency must be at most 1024"):
        settings.check(settings.from_args(EmbedSettings,
                                          parser.parse_args(["--concurrency", "1025"])))
    # --tls reads the words every boolean reads (VIT22B_TLS=on was the path of a PEM file "on")
    for word, value in (("on", True), ("Yes", True), ("off", False), ("NO", False),
                        ("roots.pem", "roots.pem")):
        assert settings.parse_tls(word) == value


def test_a_bare_boolean_flag_leaves_the_argument_after_it_alone():
    """``vit22b embed --quiet photos/ -o out`` read ``photos/`` as --quiet's value and refused
    it; a true or false after the flag is still its value, ``--`` ends the flags."""
    from vit22b.clients.embed_cli import EmbedSettings

    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--output", "-o")  # as `vit22b embed` declares it
    settings.add_arguments(parser, EmbedSettings, {})

    def parsed(*argv):
        args = parser.parse_args(settings.spell_flags(parser, list(argv)))
        return args.inputs, args.quiet, args.l2_normalize, args.output

    assert parsed("--quiet", "photos/", "-o", "out") == (["photos/"], True, False, "out")
    assert parsed("--l2-normalize", "photos/", "more/", "-q", "-o", "o") == (
        ["photos/", "more/"], True, True, "o")
    assert parsed("-q", "photos/")[:2] == (["photos/"], True)
    assert parsed("--quiet", "false", "photos/", "-o", "o") == (["photos/"], False, False, "o")
    assert parsed("photos/", "--quiet", "YES", "--l2-normalize") == (["photos/"], True, True,
                                                                     None)
    assert parsed("--quiet", "--", "--l2-normalize") == (["--l2-normalize"], True, False, None)


def test_a_flag_takes_a_list_of_negative_numbers_as_its_value(capsys):
    """``--layers -1,-4`` was argparse's "expected one argument" (a token starting with '-' is a
    flag unless it is one number): in `vit22b embed` and `vit22b probe` alike."""
    from vit22b.clients.cli import main
    from vit22b.clients.embed_cli import EmbedSettings

    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--output", "-o")
    settings.add_arguments(parser, EmbedSettings, {})
    for argv, layers in ((["x", "--layers", "-1,-4"], (-1, -4)), (["x", "--layers", "-1, 6"],
                         (-1, 6)), (["x", "--layers", "-1"], (-1,)), (["x", "--layers=-2,3"],
                         (-2, 3)), (["x", "--layers", "2,-1"], (2, -1))):
        args = parser.parse_args(settings.spell_flags(parser, argv))
        assert (args.inputs, args.layers) == (["x"], layers), argv
    spelled = settings.spell_flags(parser, ["x", "--layers", "-1,-4", "--", "--seed", "-1,-2"])
    assert spelled == ["x", "--layers=-1,-4", "--", "--seed", "-1,-2"]  # '--' ends the flags
    # the probe's own parser: --layers with --features is refused by its own rule, not argparse
    assert main(["probe", "linear", "--features", "missing.npz", "--layers", "-1,-2"]) == 2
    assert "--layers chooses the layers computed" in capsys.readouterr().err
