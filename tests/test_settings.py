"""Tests for edgellmd.settings: YAML config file to frozen, validated dataclasses."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from edgellmd.settings import (
    AuthSettings,
    ConfigError,
    HostSettings,
    LifecycleSettings,
    LockSettings,
    LoggingSettings,
    ModelSettings,
    ResponsesSettings,
    ServerSettings,
    Settings,
    SpeculativeSettings,
    check_config,
    load_settings,
    parse_settings,
)

UNSIGNED = "lock:\n  allow_unsigned: true\n"
UL = {"allow_unsigned": True}  # the lock section of unsigned (development) configs
MINIMAL = "models:\n  - name: tiny\n    file: tiny.gguf\n" + UNSIGNED
SIGNED = {"file": "models.lock", "trusted_keys": ["keys/a.pub"], "models_dir": "models", "state_dir": "state"}


def write(tmp_path: Path, content: str | bytes, name: str = "edgellm.yaml") -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def dump(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False)


def problems_of(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    return caught.value.problems


def with_model(**fields: Any) -> dict[str, Any]:
    """A config whose only model has name and file plus the given fields (None drops a key)."""
    model: dict[str, Any] = {"name": "tiny", "file": "tiny.gguf", **fields}
    return {"models": [{key: value for key, value in model.items() if value is not None}], "lock": UL}


# --- good configs -------------------------------------------------------------------------


def test_minimal_config_gives_documented_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)

    settings = load_settings(path)

    assert settings.server == ServerSettings(
        host="127.0.0.1",
        port=8080,
        max_body_bytes=1_048_576,
        max_tokens_limit=4096,
        default_max_tokens=None,
        shutdown_timeout_s=30.0,
    )
    assert settings.logging == LoggingSettings(level="info", format="json")
    assert settings.models == (
        ModelSettings(
            name="tiny",
            file=tmp_path / "tiny.gguf",
            context_size=4096,
            slots=4,
            threads=None,
            threads_batch=None,
            batch_size=512,
            gpu_layers=0,
            chat_template=None,
            chat_template_file=None,
        ),
    )
    assert settings.source == path


FULL = """\
server:
  host: 0.0.0.0
  port: 9000
  max_body_bytes: 65536
  max_tokens_limit: 2048
  max_tokens_over_limit: clamp
  default_max_tokens: 256
  shutdown_timeout_s: 5.5
  stream_write_timeout_s: 2.5
  header_timeout_s: 3.5
  body_timeout_s: 12.5
  keepalive_timeout_s: 20
  progress_timeout_s: 45
  max_connections: 99
  max_connections_per_client: 9
  tls_cert: tls/cert.pem
  tls_key: tls/key.pem
  cors_origins: [https://app.example:8443]
models:
  - name: gemma3:270m
    file: models/gemma.gguf
    context_size: 8192
    slots: 8
    threads: 6
    threads_batch: 12
    batch_size: 256
    prefill_chunk: 96
    gpu_layers: -1
    chat_template: gemma
    mmproj: gemma3-vision
    mmproj_file: models/mmproj.gguf
    queue_size: 4
    queue_timeout_s: 1.5
    evictable: true
    cache_type_k: q8_0
    cache_type_v: q4_0
    flash_attention: "on"
    prompt_cache_mb: 256
    isolation: thread
    hang_timeout_s: 12.5
    crash_loop_stops: 3
    crash_loop_window_s: 120
    batch_padding: false
    preempt_steps: false
    speculative: {mode: draft, max_draft: 12, ngram_min: 3, ngram_max: 5, max_sequences: 4,
                  draft_model: gemma3-draft, draft_file: models/draft.gguf, draft_p_min: 0.5}
    reasoning: deepseek
  - name: Tiny-1.0_b
    file: /srv/models/tiny.gguf
    chat_template_file: templates/tiny.jinja
    embedding: true
  - name: ranker
    file: /srv/models/rank.gguf
    kind: rerank
    memory_limit_mb: 2048
    memory_group: false
    memory_group_headroom_mb: 512
    inputs_per_decode: 4
logging:
  level: DEBUG
  format: text
lock:
  allow_unsigned: true
auth:
  keys_file: secrets/keys.yaml
  admin_cidrs: [10.0.0.0/8]
  proxy_cidrs: [10.0.0.5/32]
  metrics_public: true
lifecycle:
  preload_dir: shm
  preload_max_mb: 512
  watch: false
  watch_settle_s: 0.5
  memory_budget_mb: 4096
host:
  cpus: 0-3,8
  huge_pages: false
  gpu_poll_s: 2.5
  gpu_headroom_mb: 2048
responses:
  store_max_responses: 50
  store_max_mb: 8
"""


def test_full_config_round_trips_every_field(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, FULL))

    assert settings == Settings(
        server=ServerSettings(
            host="0.0.0.0",
            port=9000,
            max_body_bytes=65536,
            max_tokens_limit=2048,
            max_tokens_over_limit="clamp",
            default_max_tokens=256,
            shutdown_timeout_s=5.5,
            stream_write_timeout_s=2.5,
            header_timeout_s=3.5,
            body_timeout_s=12.5,
            keepalive_timeout_s=20.0,
            progress_timeout_s=45.0,
            max_connections=99,
            max_connections_per_client=9,
            tls_cert=tmp_path / "tls" / "cert.pem",
            tls_key=tmp_path / "tls" / "key.pem",
            cors_origins=("https://app.example:8443",),
        ),
        models=(
            ModelSettings(
                name="gemma3:270m",
                file=tmp_path / "models" / "gemma.gguf",
                context_size=8192,
                slots=8,
                threads=6,
                threads_batch=12,
                batch_size=256,
                prefill_chunk=96,
                gpu_layers=-1,
                chat_template="gemma",
                mmproj="gemma3-vision",
                mmproj_file=tmp_path / "models" / "mmproj.gguf",
                queue_size=4,
                queue_timeout_s=1.5,
                evictable=True,
                cache_type_k="q8_0",
                cache_type_v="q4_0",
                flash_attention="on",
                prompt_cache_mb=256,
                isolation="thread",
                hang_timeout_s=12.5,
                crash_loop_stops=3,
                crash_loop_window_s=120.0,
                batch_padding=False,
                preempt_steps=False,
                speculative=SpeculativeSettings(
                    mode="draft",
                    max_draft=12,
                    ngram_min=3,
                    ngram_max=5,
                    max_sequences=4,
                    draft_model="gemma3-draft",
                    draft_file=tmp_path / "models" / "draft.gguf",
                    draft_p_min=0.5,
                ),
                reasoning="deepseek",
            ),
            ModelSettings(
                name="Tiny-1.0_b",
                file=Path("/srv/models/tiny.gguf"),
                chat_template_file=tmp_path / "templates" / "tiny.jinja",
                embedding=True,
            ),
            ModelSettings(
                name="ranker",
                file=Path("/srv/models/rank.gguf"),
                kind="rerank",
                memory_limit_mb=2048,
                memory_group=False,
                memory_group_headroom_mb=512,
                inputs_per_decode=4,
            ),
        ),
        logging=LoggingSettings(level="debug", format="text"),
        auth=AuthSettings(
            keys_file=tmp_path / "secrets" / "keys.yaml",
            admin_cidrs=("10.0.0.0/8",),
            proxy_cidrs=("10.0.0.5/32",),
            metrics_public=True,
        ),
        lifecycle=LifecycleSettings(
            preload_dir=tmp_path / "shm",
            preload_max_mb=512,
            watch=False,
            watch_settle_s=0.5,
            memory_budget_mb=4096,
        ),
        host=HostSettings(cpus="0-3,8", huge_pages=False, gpu_poll_s=2.5, gpu_headroom_mb=2048),
        responses=ResponsesSettings(store_max_responses=50, store_max_mb=8),
        source=tmp_path / "edgellm.yaml",
    )


def test_full_config_sets_every_field_away_from_its_default(tmp_path: Path) -> None:
    # Guards the round-trip test above: a new field left at its default would slip past it.
    settings = load_settings(write(tmp_path, FULL))
    defaults = parse_settings(yaml.safe_load(MINIMAL), base_dir=tmp_path)
    sections: list[tuple[Any, Any]] = [
        (settings.server, defaults.server),
        (settings.logging, defaults.logging),
        (settings.auth, defaults.auth),
        (settings.lifecycle, defaults.lifecycle),
        (settings.host, defaults.host),
        (settings.responses, defaults.responses),
        (settings.models[0].speculative, defaults.models[0].speculative),
    ]
    for got, default in sections:
        for field in dataclasses.fields(got):
            assert getattr(got, field.name) != getattr(default, field.name), field.name
    for field in dataclasses.fields(ModelSettings):
        values = {getattr(model, field.name) for model in settings.models}
        assert values != {getattr(defaults.models[0], field.name)}, field.name


def test_relative_file_resolves_against_config_directory_not_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_dir = tmp_path / "etc" / "edgellm"
    config_dir.mkdir(parents=True)
    write(
        config_dir,
        dump(with_model(file="../models/tiny.gguf", chat_template_file="chat.jinja")),
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    settings = load_settings(Path("../etc/edgellm/edgellm.yaml"))

    # Absolute, joined as written: no symlink resolution, so no lexical '..' folding either.
    config_dir_as_given = elsewhere / "../etc/edgellm"
    assert settings.source == config_dir_as_given / "edgellm.yaml"
    assert settings.models[0].file == config_dir_as_given / "../models/tiny.gguf"
    assert settings.models[0].file.resolve() == (tmp_path / "etc/models/tiny.gguf").resolve()
    assert settings.models[0].chat_template_file == config_dir_as_given / "chat.jinja"


def test_absolute_file_is_kept(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, dump(with_model(file="/opt/models/x.gguf"))))

    assert settings.models[0].file == Path("/opt/models/x.gguf")


def test_parse_settings_makes_a_relative_base_dir_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)

    settings = parse_settings(with_model(), base_dir=Path("conf"))

    assert settings.models[0].file == tmp_path / "conf" / "tiny.gguf"
    assert settings.source is None


def test_threads_alone_leaves_threads_batch_to_the_engine(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, dump(with_model(threads=3))))

    assert (settings.models[0].threads, settings.models[0].threads_batch) == (3, None)


def test_empty_server_and_logging_sections_mean_defaults(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, "server:\nlogging:\n" + MINIMAL))

    assert settings.server == ServerSettings()
    assert settings.logging == LoggingSettings()


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("server", "port", 1),
        ("server", "port", 65535),
        ("server", "max_body_bytes", 1024),
        ("server", "max_tokens_limit", 1),
        ("server", "default_max_tokens", 1),
        ("server", "default_max_tokens", 4096),
        ("server", "shutdown_timeout_s", 5),
        ("server", "shutdown_timeout_s", 0.001),
        ("server", "host", "::1"),
        ("model", "context_size", 64),
        ("model", "context_size", 1_048_576),
        ("model", "slots", 1),
        ("model", "slots", 256),
        ("model", "threads", 1),
        ("model", "threads", 1024),
        ("model", "threads_batch", 1024),
        ("model", "batch_size", 1),
        ("model", "batch_size", 65536),
        ("model", "gpu_layers", -1),
        ("model", "gpu_layers", 100_000),
        ("model", "gpu_layers", "auto"),
        ("model", "name", "a"),
        ("model", "name", "A" * 64),
        ("model", "name", "qwen2.5:0.5b-instruct_q4"),
        ("model", "chat_template", "llama3"),
        ("model", "chat_template", "x" * 64),
        ("logging", "level", "Warning"),
        ("logging", "level", "error"),
    ],
)
def test_edge_values_are_accepted(tmp_path: Path, section: str, key: str, value: object) -> None:
    data = with_model(**({key: value} if section == "model" else {}))
    if section != "model":
        data[section] = {key: value}

    settings = load_settings(write(tmp_path, dump(data)))

    target = settings.models[0] if section == "model" else getattr(settings, section)
    expected = value.lower() if isinstance(value, str) and section == "logging" else value
    assert getattr(target, key) == expected


# --- bad configs --------------------------------------------------------------------------

# (id, file content, key path the problem must start with, fragment of its message).
# Content is a dict (dumped to YAML) or raw text; "{file}" in the path stands for the file.
# One row per case reads better than the formatter's one value per line.
# fmt: off
BAD: list[tuple[str, Any, str, str]] = [
    # server
    ("port-string", {**with_model(), "server": {"port": "http"}}, "server.port",
     "must be an integer from 1 to 65535, got 'http'"),
    ("port-zero", {**with_model(), "server": {"port": 0}}, "server.port",
     "from 1 to 65535, got 0"),
    ("port-too-big", {**with_model(), "server": {"port": 65536}}, "server.port",
     "from 1 to 65535, got 65536"),
    ("port-bool", {**with_model(), "server": {"port": True}}, "server.port",
     "must be an integer from 1 to 65535, got True"),
    ("port-float", {**with_model(), "server": {"port": 8080.0}}, "server.port",
     "must be an integer from 1 to 65535, got 8080.0"),
    ("port-null", {**with_model(), "server": {"port": None}}, "server.port", "got None"),
    ("port-huge-literal", "server:\n  port: 1" + "0" * 5000 + "\n" + MINIMAL, "{file}",
     "a value YAML cannot read (Exceeds the limit"),
    ("impossible-date", "server:\n  host: 2027-02-30\n" + MINIMAL, "{file}",
     "a value YAML cannot read (day is out of range for month)"),
    ("bad-timestamp-tag", "server:\n  host: !!timestamp soon\n" + MINIMAL, "{file}",
     "a value YAML cannot read"),
    ("host-empty", {**with_model(), "server": {"host": ""}}, "server.host",
     "must be a non-empty host name or address, got ''"),
    ("host-int", {**with_model(), "server": {"host": 127}}, "server.host", "got 127"),
    ("body-too-small", {**with_model(), "server": {"max_body_bytes": 1023}},
     "server.max_body_bytes", "must be an integer >= 1024, got 1023"),
    ("tokens-limit-zero", {**with_model(), "server": {"max_tokens_limit": 0}},
     "server.max_tokens_limit", "must be an integer >= 1, got 0"),
    ("default-tokens-zero", {**with_model(), "server": {"default_max_tokens": 0}},
     "server.default_max_tokens", "must be null or an integer from 1 to 4096, got 0"),
    ("default-tokens-over-limit",
     {**with_model(), "server": {"max_tokens_limit": 256, "default_max_tokens": 257}},
     "server.default_max_tokens", "from 1 to 256, got 257"),
    ("timeout-zero", {**with_model(), "server": {"shutdown_timeout_s": 0}},
     "server.shutdown_timeout_s", "must be a finite number > 0, got 0"),
    ("timeout-negative", {**with_model(), "server": {"shutdown_timeout_s": -1.5}},
     "server.shutdown_timeout_s", "got -1.5"),
    ("timeout-inf", "server:\n  shutdown_timeout_s: .inf\n" + MINIMAL,
     "server.shutdown_timeout_s", "got inf"),
    ("timeout-string", {**with_model(), "server": {"shutdown_timeout_s": "30s"}},
     "server.shutdown_timeout_s", "got '30s'"),
    ("timeout-bool", {**with_model(), "server": {"shutdown_timeout_s": True}},
     "server.shutdown_timeout_s", "got True"),
    ("server-unknown-key", {**with_model(), "server": {"colour": "red"}}, "server.colour",
     "unknown key (expected one of body_timeout_s, cors_origins, default_max_tokens, "
     "header_timeout_s, host, keepalive_timeout_s, max_body_bytes, max_connections, "
     "max_connections_per_client, max_tokens_limit, max_tokens_over_limit, port, progress_timeout_s, "
     "shutdown_timeout_s, stream_write_timeout_s, tls_cert, tls_key)"),
    ("server-not-mapping", {**with_model(), "server": [8080]}, "server",
     "must be a mapping with keys host, port"),
    # models
    ("context-too-small", with_model(context_size=63), "models[0].context_size",
     "must be an integer from 64 to 1048576, got 63"),
    ("context-too-big", with_model(context_size=1_048_577), "models[0].context_size",
     "got 1048577"),
    ("slots-zero", with_model(slots=0), "models[0].slots",
     "must be an integer from 1 to 256, got 0"),
    ("slots-too-many", with_model(slots=257), "models[0].slots", "got 257"),
    ("slots-float", with_model(slots=2.0), "models[0].slots", "got 2.0"),
    ("slots-string", with_model(slots="4"), "models[0].slots", "got '4'"),
    ("slots-bool", with_model(slots=True), "models[0].slots", "got True"),
    ("threads-zero", with_model(threads=0), "models[0].threads",
     "must be null or an integer from 1 to 1024, got 0"),
    ("threads-too-many", with_model(threads=1025), "models[0].threads", "got 1025"),
    ("threads-bool", with_model(threads=False), "models[0].threads", "got False"),
    ("threads-batch-zero", with_model(threads_batch=0), "models[0].threads_batch", "got 0"),
    ("threads-batch-too-many", with_model(threads_batch=1025), "models[0].threads_batch",
     "got 1025"),
    ("batch-zero", with_model(batch_size=0), "models[0].batch_size",
     "must be an integer from 1 to 65536, got 0"),
    ("batch-too-big", with_model(batch_size=65537), "models[0].batch_size", "got 65537"),
    ("gpu-layers-minus-two", with_model(gpu_layers=-2), "models[0].gpu_layers",
     "must be -1 or an integer from 0 to 100000, got -2"),
    ("gpu-layers-too-many", with_model(gpu_layers=100_001), "models[0].gpu_layers",
     "got 100001"),
    ("gpu-layers-string", with_model(gpu_layers="all"), "models[0].gpu_layers", "got 'all'"),
    ("gpu-layers-auto-uppercase", with_model(gpu_layers="AUTO"), "models[0].gpu_layers",
     "must be -1 or an integer from 0 to 100000, got 'AUTO'"),
    ("embedding-string", with_model(embedding="yes"), "models[0].embedding",
     "must be true or false, got 'yes'"),
    ("evictable-int", with_model(evictable=1), "models[0].evictable", "must be true or false, got 1"),
    ("tls-half", {**with_model(), "server": {"tls_key": "k.pem"}}, "server.tls_cert",
     "tls_cert and tls_key go together: set both or neither"),
    ("cors-wildcard", {**with_model(), "server": {"cors_origins": ["https://a.example", "*"]}},
     "server.cors_origins[1]", "must be an origin like https://app.example:8443, got '*'"),
    ("cors-string", {**with_model(), "server": {"cors_origins": "https://a.example"}}, "server.cors_origins",
     "must be a list, got 'https://a.example'"),
    ("host-public-without-keys", {**with_model(), "server": {"host": "0.0.0.0"}}, "server.host",
     "'0.0.0.0' is not a loopback address: serving a network without API keys is refused; "
     "set auth.keys_file"),
    # auth and host
    ("cidr-prefix-too-long", {**with_model(), "auth": {"admin_cidrs": ["10.0.0.0/8", "10.0.0.0/33"]}},
     "auth.admin_cidrs[1]", "must be a network like 10.0.0.0/8, got '10.0.0.0/33'"),
    ("metrics-public-string", {**with_model(), "auth": {"metrics_public": "yes"}}, "auth.metrics_public",
     "must be true or false, got 'yes'"),
    ("huge-pages-string", {**with_model(), "host": {"huge_pages": "yes"}}, "host.huge_pages", "got 'yes'"),
    ("cpus-list", {**with_model(), "host": {"cpus": [0, 1]}}, "host.cpus",
     "must be a CPU list like \"0-3,8\" or \"auto\", got [0, 1]"),
    ("headroom-negative", {**with_model(), "host": {"gpu_headroom_mb": -1}}, "host.gpu_headroom_mb",
     "must be an integer >= 0, got -1"),
    # lock
    ("lock-missing", {"models": [{"name": "tiny", "file": "tiny.gguf"}]}, "lock",
     "required: name the signed lockfile (lock.file, lock.trusted_keys, lock.models_dir, lock.state_dir), "
     "or set lock.allow_unsigned: true for development"),
    ("lock-unsigned-with-a-file", {**with_model(), "lock": {"allow_unsigned": True, "file": "m.lock"}},
     "lock.file", "cannot be combined with lock.allow_unsigned: true"),
    ("lock-keys-empty", {"models": [{"name": "tiny"}], "lock": {**SIGNED, "trusted_keys": []}},
     "lock.trusted_keys", "must be a non-empty list of public key files, got []"),
    ("lock-key-empty", {"models": [{"name": "tiny"}], "lock": {**SIGNED, "trusted_keys": ["a.pub", ""]}},
     "lock.trusted_keys[1]", "must be a non-empty string (a file path), got ''"),
    ("model-file-with-a-lock", {"models": [{"name": "tiny", "file": "t.gguf"}], "lock": SIGNED},
     "models[0].file", "not allowed with a lockfile: the lock names each model's file"),
    # lifecycle
    ("lifecycle-list", {**with_model(), "lifecycle": [1]}, "lifecycle", "must be a mapping"),
    ("lifecycle-unknown", {**with_model(), "lifecycle": {"shm": 1}}, "lifecycle.shm", "unknown key"),
    ("preload-dir-int", {**with_model(), "lifecycle": {"preload_dir": 5}}, "lifecycle.preload_dir",
     "must be a non-empty string"),
    ("preload-max-zero", {**with_model(), "lifecycle": {"preload_max_mb": 0}},
     "lifecycle.preload_max_mb", "null or an integer >= 1, got 0"),
    ("watch-string", {**with_model(), "lifecycle": {"watch": "on"}}, "lifecycle.watch",
     "must be true or false"),
    ("settle-zero", {**with_model(), "lifecycle": {"watch_settle_s": 0}}, "lifecycle.watch_settle_s",
     "must be a finite number > 0, got 0"),
    ("budget-negative", {**with_model(), "lifecycle": {"memory_budget_mb": -5}},
     "lifecycle.memory_budget_mb", "got -5"),
    ("name-missing", {"models": [{"file": "tiny.gguf"}], "lock": UL}, "models[0].name", "required"),
    ("name-null", {"models": [{"name": None, "file": "tiny.gguf"}], "lock": UL}, "models[0].name",
     "required"),
    ("file-missing", {"models": [{"name": "tiny"}], "lock": UL}, "models[0].file",
     "required (lock.allow_unsigned is set)"),
    ("file-empty", with_model(file=""), "models[0].file",
     "must be a non-empty string (a file path), got ''"),
    ("file-int", with_model(file=42), "models[0].file", "got 42"),
    ("name-space", with_model(name="my model"), "models[0].name",
     "must be 1 to 64 characters of A-Z a-z 0-9 . _ : - starting with a letter or digit, "
     "got 'my model'"),
    ("name-leading-dash", with_model(name="-tiny"), "models[0].name", "got '-tiny'"),
    ("name-slash", with_model(name="a/b"), "models[0].name", "got 'a/b'"),
    ("name-too-long", with_model(name="a" * 65), "models[0].name", "must be 1 to 64"),
    ("name-int", with_model(name=7), "models[0].name", "got 7"),
    ("template-uppercase", with_model(chat_template="Gemma"), "models[0].chat_template",
     "must be a built-in template name of 1 to 64 characters of a-z 0-9 _ . -, got 'Gemma'"),
    ("template-file-empty", with_model(chat_template_file=""), "models[0].chat_template_file",
     "must be a non-empty string"),
    ("both-templates", with_model(chat_template="gemma", chat_template_file="t.jinja"),
     "models[0].chat_template", "cannot be combined with models[0].chat_template_file"),
    ("kv-type-unknown", with_model(cache_type_k="q5_1"), "models[0].cache_type_k",
     "must be one of f16, q8_0, q4_0, got 'q5_1'"),
    ("kv-quantized-values-without-flash", with_model(cache_type_v="q8_0", flash_attention="off"),
     "models[0].cache_type_v", "q8_0 values need flash attention; flash_attention is off"),
    ("flash-attention-bool", with_model(flash_attention=True), "models[0].flash_attention", "got True"),
    ("prompt-cache-negative", with_model(prompt_cache_mb=-1), "models[0].prompt_cache_mb", "got -1"),
    ("batch-padding-string", with_model(batch_padding="yes"), "models[0].batch_padding", "got 'yes'"),
    ("prompt-cache-on-embedding", with_model(embedding=True, prompt_cache_mb=64),
     "models[0].prompt_cache_mb", "an embedding model keeps no prompt cache"),
    ("model-inputs-per-decode-on-generation", with_model(inputs_per_decode=4),
     "models[0].inputs_per_decode", "packs the inputs of embedding and rerank models"),
    ("model-inputs-per-decode-zero", with_model(kind="embedding", inputs_per_decode=0),
     "models[0].inputs_per_decode", "from 1 to 256"),
    ("speculative-mode-unknown", with_model(speculative={"mode": "eagle"}), "models[0].speculative.mode",
     "got 'eagle'"),
    ("speculative-not-mapping", with_model(speculative="ngram"), "models[0].speculative", "got 'ngram'"),
    ("speculative-unknown-key", with_model(speculative={"draft_models": "x.gguf"}),
     "models[0].speculative.draft_models", "unknown key"),
    ("speculative-draft-without-file", with_model(speculative={"mode": "draft"}),
     "models[0].speculative.draft_file", "required with mode draft (lock.allow_unsigned is set)"),
    ("speculative-draft-mode-cased", with_model(speculative={"mode": "Draft"}),
     "models[0].speculative.draft_file", "required with mode draft"),
    ("speculative-draft-without-model", {"models": [{"name": "tiny", "speculative": {"mode": "draft"}}],
                                         "lock": SIGNED},
     "models[0].speculative.draft_model", "required with mode draft: the draft model's name in the lockfile"),
    ("speculative-draft-file-with-a-lock",
     {"models": [{"name": "tiny", "speculative": {"mode": "draft", "draft_model": "small",
                                                  "draft_file": "s.gguf"}}], "lock": SIGNED},
     "models[0].speculative.draft_file", "not allowed with a lockfile: the lock names the draft model"),
    ("speculative-draft-file-without-mode", with_model(speculative={"draft_file": "s.gguf"}),
     "models[0].speculative.draft_file", "only with mode draft (mode is none)"),
    ("speculative-draft-model-with-ngram", with_model(speculative={"mode": "ngram", "draft_model": "small"}),
     "models[0].speculative.draft_model", "only with mode draft (mode is ngram)"),
    ("speculative-draft-model-bad-name",
     with_model(speculative={"mode": "draft", "draft_file": "s.gguf", "draft_model": "a/b"}),
     "models[0].speculative.draft_model", "must be a model name of 1 to 64 characters"),
    ("speculative-draft-itself",
     with_model(speculative={"mode": "draft", "draft_file": "s.gguf", "draft_model": "tiny"}),
     "models[0].speculative.draft_model", "names this model itself ('tiny')"),
    ("speculative-draft-file-empty", with_model(speculative={"mode": "draft", "draft_file": ""}),
     "models[0].speculative.draft_file", "must be a non-empty string (a file path)"),
    ("speculative-draft-on-embedding",
     with_model(embedding=True, speculative={"mode": "draft", "draft_file": "s.gguf"}),
     "models[0].speculative.mode", "an embedding model generates no text to draft"),
    ("speculative-p-min-above-one", with_model(speculative={"draft_p_min": 1.5}),
     "models[0].speculative.draft_p_min", "must be a number from 0 to 1, got 1.5"),
    ("speculative-p-min-negative", with_model(speculative={"draft_p_min": -0.1}),
     "models[0].speculative.draft_p_min", "got -0.1"),
    ("speculative-p-min-string", with_model(speculative={"draft_p_min": "0.5"}),
     "models[0].speculative.draft_p_min", "got '0.5'"),
    ("speculative-p-min-bool", with_model(speculative={"draft_p_min": True}),
     "models[0].speculative.draft_p_min", "got True"),
    ("speculative-p-min-nan",
     "models:\n  - name: tiny\n    file: tiny.gguf\n    speculative: {draft_p_min: .nan}\n" + UNSIGNED,
     "models[0].speculative.draft_p_min", "got nan"),
    ("speculative-draft-zero", with_model(speculative={"max_draft": 0}), "models[0].speculative.max_draft",
     "got 0"),
    ("speculative-ngram-inverted", with_model(speculative={"ngram_min": 4, "ngram_max": 2}),
     "models[0].speculative.ngram_min", "4 is more than ngram_max (2)"),
    ("speculative-on-embedding", with_model(embedding=True, speculative={"mode": "ngram"}),
     "models[0].speculative.mode", "an embedding model generates no text to draft"),
    ("mmproj-on-embedding", with_model(embedding=True, mmproj_file="p.gguf"), "models[0].mmproj_file",
     "an embedding model reads no images or audio: a projector is for kind generation"),
    ("mmproj-on-rerank", {"models": [{"name": "tiny", "kind": "rerank", "mmproj": "vision"}], "lock": SIGNED},
     "models[0].mmproj", "a rerank model reads no images or audio"),
    ("mmproj-file-on-embedding-with-a-lock",
     {"models": [{"name": "tiny", "kind": "embedding", "mmproj_file": "p.gguf"}], "lock": SIGNED},
     "models[0].mmproj_file", "an embedding model reads no images or audio"),
    ("mmproj-without-file-unsigned", with_model(mmproj="vision"), "models[0].mmproj_file",
     "required with mmproj (lock.allow_unsigned is set): the projector's GGUF file"),
    ("mmproj-file-with-a-lock",
     {"models": [{"name": "tiny", "mmproj": "vision", "mmproj_file": "p.gguf"}], "lock": SIGNED},
     "models[0].mmproj_file", "not allowed with a lockfile: the lock names the projector's file"),
    ("mmproj-bad-name", with_model(mmproj="a/b", mmproj_file="p.gguf"), "models[0].mmproj",
     "must be a model name of 1 to 64 characters"),
    ("mmproj-itself", {"models": [{"name": "tiny", "mmproj": "tiny"}], "lock": SIGNED}, "models[0].mmproj",
     "names this model itself ('tiny'): the projector is a file of its own"),
    ("mmproj-file-empty", with_model(mmproj_file=""), "models[0].mmproj_file",
     "must be a non-empty string (a file path)"),
    ("model-unknown-key", with_model(n_ctx=2048), "models[0].n_ctx",
     "unknown key (expected one of batch_padding, batch_size, cache_type_k, cache_type_v, chat_template, "
     "chat_template_file"),
    ("model-not-mapping", {"models": ["tiny.gguf"], "lock": UL}, "models[0]",
     "must be a mapping with keys name, file, context_size"),
    ("duplicate-names",
     {"models": [{"name": "x", "file": "a.gguf"}, {"name": "x", "file": "b.gguf"}], "lock": UL},
     "models[1].name", "duplicate model name 'x' (also models[0])"),
    ("models-mapping", {"models": {"name": "tiny", "file": "tiny.gguf"}, "lock": UL}, "models",
     "must be a non-empty list of model mappings"),
    ("models-empty", {"models": [], "lock": UL}, "models",
     "must be a non-empty list of model mappings"),
    ("models-null", {"models": None, "lock": UL}, "models", "must be a non-empty list"),
    ("models-missing", {"server": {"port": 8080}, "lock": UL}, "models",
     "required; must be a non-empty list of model mappings"),
    # logging
    ("level-unknown", {**with_model(), "logging": {"level": "verbose"}}, "logging.level",
     "must be one of debug, info, warning, error, got 'verbose'"),
    ("level-yaml-bool", "logging:\n  level: off\n" + MINIMAL, "logging.level", "got False"),
    ("format-unknown", {**with_model(), "logging": {"format": "xml"}}, "logging.format",
     "must be one of json, text, got 'xml'"),
    ("logging-unknown-key", {**with_model(), "logging": {"file": "/var/log/x"}},
     "logging.file", "unknown key (expected one of format, level)"),
    # top level and file
    ("top-unknown-key", {**with_model(), "servers": {}}, "servers",
     "unknown key (expected one of auth, console, host, ledger, lifecycle, lock, logging, media, "
     "models, responses, server, telemetry)"),
    ("top-non-string-key", "1: one\n" + MINIMAL, "1", "unknown key"),
    ("top-level-list", "- name: tiny\n  file: tiny.gguf\n", "(top level)",
     "must be a mapping with keys server, models, logging, lock, auth, lifecycle, host, responses, "
     "console, ledger, telemetry, media, got [{"),
    ("top-level-string", "just text\n", "(top level)", "got 'just text'"),
    ("empty-file", "", "{file}", "config file is empty"),
    ("comments-only", "# nothing yet\n", "{file}", "config file is empty"),
    ("syntax-error", "models:\n  - name: tiny\n    file: [unclosed\n", "{file}",
     "YAML syntax error at line 4, column 1: while parsing a flow sequence"),
    ("bad-indent", "server:\n  port: 8080\n bad: x\n", "{file}",
     "YAML syntax error at line 3, column 2"),
    ("tab-indent", "server:\n\tport: 8080\n", "{file}",
     "YAML syntax error at line 2, column 1: "),
    ("two-documents", MINIMAL + "---\n" + MINIMAL, "{file}",
     "expected a single document in the stream"),
    ("python-tag", "x: !!python/object/apply:os.system ['true']\n", "{file}",
     "unsupported YAML at line 1, column 4"),
    ("duplicate-key", "server:\n  port: 80\n  port: 81\n" + MINIMAL, "server.port",
     "duplicate key (lines 2 and 3)"),
    ("duplicate-model-key", "models:\n  - name: a\n    file: x\n    file: y\n" + UNSIGNED,
     "models[0].file", "duplicate key (lines 3 and 4)"),
    ("not-utf8", b"models: [{name: caf\xe9, file: x}]\n", "{file}",
     "config file is not UTF-8 (bad byte at offset 19)"),
]
# fmt: on


@pytest.mark.parametrize(
    ("content", "path", "fragment"),
    [pytest.param(content, path, fragment, id=row_id) for row_id, content, path, fragment in BAD],
)
def test_bad_config_names_the_key_path(tmp_path: Path, content: Any, path: str, fragment: str) -> None:
    config = write(tmp_path, content if isinstance(content, str | bytes) else dump(content))
    where = path.format(file=config)

    problems = problems_of(config)

    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{where}: "), problems
    assert fragment in problems[0], problems


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        """\
server:
  port: true
  colour: red
models:
  - name: a
    file: a.gguf
    slots: 0
  - file: b.gguf
    gpu_layers: 1.5
  - name: a
    file: c.gguf
logging:
  level: loud
lock:
  allow_unsigned: true
""",
    )

    with pytest.raises(ConfigError) as caught:
        load_settings(config)

    expected = [
        "server.colour: unknown key (expected one of body_timeout_s, cors_origins, "
        "default_max_tokens, header_timeout_s, host, keepalive_timeout_s, max_body_bytes, "
        "max_connections, max_connections_per_client, max_tokens_limit, max_tokens_over_limit, port, "
        "progress_timeout_s, shutdown_timeout_s, stream_write_timeout_s, tls_cert, tls_key)",
        "server.port: must be an integer from 1 to 65535, got True",
        "models[0].slots: must be an integer from 1 to 256, got 0",
        "models[1].name: required",
        "models[1].gpu_layers: must be -1 or an integer from 0 to 100000, got 1.5",
        "models[2].name: duplicate model name 'a' (also models[0])",
        "logging.level: must be one of debug, info, warning, error, got 'loud'",
    ]
    assert caught.value.problems == expected
    assert str(caught.value) == "\n".join(expected)


def test_a_signed_lock_needs_its_four_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings({"models": [{"name": "tiny"}], "lock": {"file": 5}}, base_dir=tmp_path)

    assert caught.value.problems == [
        "lock.file: must be a non-empty string (a file path), got 5",
        "lock.trusted_keys: must be a non-empty list of public key files, got None",
        "lock.models_dir: required",
        "lock.state_dir: required",
    ]


def test_a_signed_lock_is_read_relative_to_the_config(tmp_path: Path) -> None:
    settings = parse_settings({"models": [{"name": "tiny"}], "lock": SIGNED}, base_dir=tmp_path)

    assert settings.lock == LockSettings(
        file=tmp_path / "models.lock",
        trusted_keys=(tmp_path / "keys/a.pub",),
        models_dir=tmp_path / "models",
        state_dir=tmp_path / "state",
    )
    assert settings.models[0].file is None


def test_duplicate_keys_are_reported_with_other_problems(tmp_path: Path) -> None:
    config = write(tmp_path, "server:\n  port: 80\n  port: 0\n" + MINIMAL)

    assert problems_of(config) == [
        "server.port: duplicate key (lines 2 and 3)",
        "server.port: must be an integer from 1 to 65535, got 0",
    ]


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        """\
models:
  - &base {name: a, file: a.gguf, slots: 2}
  - <<: *base
    name: b
lock:
  allow_unsigned: true
""",
    )

    settings = load_settings(config)

    assert [(model.name, model.slots) for model in settings.models] == [("a", 2), ("b", 2)]


def test_huge_values_are_not_echoed(tmp_path: Path) -> None:
    secret = "sk-" + "x" * 10_000
    config = write(tmp_path, dump(with_model(name=secret, slots=[secret] * 3)))

    problems = problems_of(config)

    assert [problem.split(":")[0] for problem in problems] == [
        "models[0].name",
        "models[0].slots",
    ]
    for problem in problems:
        assert "x" * 50 not in problem
        assert len(problem) < 200


def test_unknown_key_with_odd_characters_is_quoted_and_cut(tmp_path: Path) -> None:
    config = write(tmp_path, dump({**with_model(), "server": {"bad key\n" + "y" * 500: 1}}))

    (problem,) = problems_of(config)

    assert problem.startswith("server.'bad key\\n")
    assert "y" * 50 not in problem


def test_parse_settings_rejects_non_mapping_data(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings(None, base_dir=tmp_path)

    assert caught.value.problems == [
        "(top level): must be a mapping with keys server, models, logging, lock, auth, lifecycle, host, "
        "responses, console, ledger, telemetry, media, got None"
    ]


# --- check_config -------------------------------------------------------------------------


def test_check_config_returns_nothing_for_a_good_file(tmp_path: Path) -> None:
    assert check_config(write(tmp_path, FULL)) == []


def test_check_config_returns_the_problems_for_a_bad_file(tmp_path: Path) -> None:
    config = write(tmp_path, dump(with_model(slots=0, context_size=1)))

    assert check_config(str(config)) == [
        "models[0].context_size: must be an integer from 64 to 1048576, got 1",
        "models[0].slots: must be an integer from 1 to 256, got 0",
    ]


def test_check_config_reports_a_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"

    assert check_config(missing) == [f"{missing}: cannot read config file: No such file or directory"]


def test_check_config_reports_a_directory(tmp_path: Path) -> None:
    assert check_config(tmp_path) == [f"{tmp_path}: cannot read config file: Is a directory"]


def test_check_config_refuses_an_oversized_file(tmp_path: Path) -> None:
    config = write(tmp_path, MINIMAL + "#" * 2_000_000 + "\n")

    assert check_config(config) == [f"{config}: config file is larger than 1048576 bytes"]


def test_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    config = write(tmp_path, b"\xef\xbb\xbf" + MINIMAL.encode())

    assert check_config(config) == []


# --- immutability -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "attribute"),
    [
        (ServerSettings(), "port"),
        (LoggingSettings(), "level"),
        (ModelSettings(name="tiny", file=Path("/m/tiny.gguf")), "slots"),
        (Settings(server=ServerSettings(), models=(), logging=LoggingSettings()), "models"),
    ],
)
def test_settings_are_frozen(obj: object, attribute: str) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, attribute, 1)
