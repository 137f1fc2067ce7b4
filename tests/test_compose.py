"""docker-compose.yml and the Dockerfile, checked without Docker.

The compose file must parse, every service's command must be a real ``redserve`` subcommand with
valid flags (parsed by `redserve.cli.build_parser` with the service's environment), every REDSERVE_*
variable it sets must be one the code reads, and the same commands, started as local processes (the
redis service's own command too, on this machine's Redis-compatible server), must serve a request and
a small batch and pass their healthchecks.
Safe to expose: the API key and the Redis passwords are required and reach the services through the
environment only (never a command line), published ports bind 127.0.0.1 unless the user opts out,
every service runs with no-new-privileges, no capabilities, an init process and a restart policy.
What a user types from the docs works: the README's `.env` recipe satisfies every required variable, the
admin redis-cli command of the header and README gets in as `admin` when typed in a shell, one service
builds the image, the API's healthcheck (liveness) passes with no engine while /health is 503, the batch
worker's healthcheck passes against a live worker, and a missing model directory is one error line.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import yaml
from stack_procs import Procs, engine_ready, free_port, title, wait_for

from broker.keys import RedisKeys
from redserve.cli import build_parser
from redserve.redis_conf import APP_USER, APP_USER_RULES
from redserve.redis_server import redis_cli_path, redis_server_path

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
README = ROOT / "README.md"
GPU_OVERRIDE = ROOT / "docker-compose.gpu.yml"
REDSERVE_SERVICES = {"coordinator", "engine-0", "engine-1", "api", "batch-worker"}
MONITORING_SERVICES = {"prometheus", "grafana"}
HA_SERVICES = {"redis-replica-1", "redis-replica-2", "sentinel-1", "sentinel-2", "sentinel-3"}
HA_ENV = {"REDSERVE_REDIS_SCHEME": "redis+sentinel", "REDSERVE_REDIS_PATH": "redserve/0",
          "REDSERVE_REDIS_HOSTS": "sentinel-1:26379,sentinel-2:26379,sentinel-3:26379"}
MONITORING = ROOT / "monitoring"
SECRETS = {"REDSERVE_API_KEY": "api-key-4b1d", "REDSERVE_REDIS_PASSWORD": "app9c0ffee",
           "REDSERVE_REDIS_ADMIN_PASSWORD": "admin7e57ab1e"}
_VAR = re.compile(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<default>[^}]*))?\}")


class MissingVariable(ValueError):
    """A ${VAR:?message} whose variable is unset or empty: compose refuses to start."""


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution over a parsed file: ${VAR}, ${VAR:-default}, ${VAR-default},
    ${VAR:?error}, ${VAR?error} and $$ (a literal $)."""
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            name, op, default = m["name"], m["op"], m["default"] or ""
            if name is None:
                return "$"
            if op == ":-":
                return env.get(name) or default
            if op == "-":
                return env.get(name, default)
            if op in (":?", "?") and (name not in env or (op == ":?" and not env[name])):
                raise MissingVariable(f"{name}: {default}")
            return env.get(name, "")

        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def load(path: Path, env: dict[str, str] | None = None, secrets: bool = True) -> dict[str, Any]:
    """The file with `env` substituted (plus the required `SECRETS` unless `secrets` is False)."""
    return interpolate(yaml.safe_load(path.read_text()), {**(SECRETS if secrets else {}), **(env or {})})


def parse_command(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch):
    """The argparse namespace of a service's command, parsed with the service's environment."""
    argv = service["command"]
    assert argv[0] == "redserve", f"{argv} does not run the redserve entry point"
    for name, value in service.get("environment", {}).items():
        monkeypatch.setenv(name, str(value))
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit as e:
        raise AssertionError(f"invalid command {argv}") from e


def test_compose_file_has_the_stack() -> None:
    compose = load(COMPOSE)
    services = compose["services"]
    assert set(services) == {"redis", *REDSERVE_SERVICES, *MONITORING_SERVICES, *HA_SERVICES}
    assert services["redis"]["healthcheck"]["test"][-1] == "ping"
    assert services["engine-1"]["profiles"] == ["dp2"] and "profiles" not in services["engine-0"]
    for name in REDSERVE_SERVICES:
        service = services[name]
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        assert service["environment"]["REDSERVE_REDIS_URL"] == f"redis://{APP_USER}:app9c0ffee@redis:6379/0"
        assert service["environment"]["REDSERVE_MODEL"] == "/models/model"
        assert "./models:/models:ro" in service["volumes"]
    assert services["api"]["ports"] == ["127.0.0.1:8000:8000"]
    assert services["api"]["environment"]["REDSERVE_API_KEY"] == SECRETS["REDSERVE_API_KEY"]
    assert services["engine-0"]["environment"]["REDSERVE_TENSOR_PARALLEL_SIZE"] == "1"
    custom = load(COMPOSE, {"REDSERVE_MODEL_DIR": "/srv/m", "REDSERVE_TENSOR_PARALLEL_SIZE": "4"})["services"]
    assert custom["engine-1"]["environment"]["REDSERVE_TENSOR_PARALLEL_SIZE"] == "4"
    assert "/srv/m:/models:ro" in custom["api"]["volumes"]


def test_ha_profile_runs_replicas_and_sentinels_that_every_service_finds() -> None:
    from broker.connection import parse_sentinel_url
    from redserve.redis_conf import MASTER_NAME, SENTINEL_APP_RULES

    services = load(COMPOSE, HA_ENV)["services"]
    assert all(services[name]["profiles"] == ["ha"] for name in HA_SERVICES) and "profiles" not in services["redis"]
    url = parse_sentinel_url(services["api"]["environment"]["REDSERVE_REDIS_URL"])
    assert url.sentinels == (("sentinel-1", 26379), ("sentinel-2", 26379), ("sentinel-3", 26379))
    assert (url.master, url.db, url.username, url.password) == (MASTER_NAME, 0, APP_USER, "app9c0ffee")
    for name in REDSERVE_SERVICES:
        assert services[name]["environment"]["REDSERVE_REDIS_URL"] == services["api"]["environment"]["REDSERVE_REDIS_URL"]
    for name in ("redis", "redis-replica-1", "redis-replica-2"):
        script = services[name]["command"][-1]
        assert services[name]["environment"]["REDIS_MODE"] == "redis+sentinel"
        assert "masterauth $REDIS_ADMIN_PASSWORD" in script and f"get-master-addr-by-name {MASTER_NAME}" in script
        assert services[name]["environment"]["REDIS_NODE"] == name
    assert services["redis-replica-1"]["environment"]["REDIS_DEFAULT_PRIMARY"] == "redis"
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        script = services[name]["command"][-1]
        assert f"user {APP_USER} on >$REDIS_APP_PASSWORD {SENTINEL_APP_RULES}" in script
        assert f"sentinel monitor {MASTER_NAME} $primary 6379 2" in script and "redis-sentinel /data/sentinel.conf" in script
    plain = load(COMPOSE)["services"]  # without the ha variables: one server, as before
    assert plain["redis"]["environment"]["REDIS_MODE"] == "redis"


def test_every_command_is_a_valid_redserve_command(monkeypatch: pytest.MonkeyPatch) -> None:
    services = load(COMPOSE, {"REDSERVE_TENSOR_PARALLEL_SIZE": "2", "REDSERVE_DTYPE": "bfloat16"})["services"]
    expected = {"coordinator": "coordinator", "engine-0": "engine", "engine-1": "engine", "api": "api",
                "batch-worker": "batch"}
    parsed = {}
    for name in REDSERVE_SERVICES:
        with monkeypatch.context() as m:
            parsed[name] = args = parse_command(services[name], m)
        assert args.command == expected[name]
        assert args.redis_url == f"redis://{APP_USER}:app9c0ffee@redis:6379/0", name
    for rank in (0, 1):
        engine = parsed[f"engine-{rank}"]
        assert (engine.dp_rank, engine.tensor_parallel_size, engine.dtype) == (rank, 2, "bfloat16")
        assert engine.model == "/models/model"
    assert (parsed["api"].model, parsed["api"].host, parsed["api"].port) == ("/models/model", "0.0.0.0", 8000)
    assert parsed["api"].api_key == SECRETS["REDSERVE_API_KEY"] and not parsed["api"].public_metrics
    assert parsed["batch-worker"].batch_command == "worker" and parsed["batch-worker"].concurrency == 2
    assert parsed["batch-worker"].model == "/models/model"
    ping = parse_command({**services["batch-worker"], "command": services["batch-worker"]["healthcheck"]["test"][1:]},
                         monkeypatch)
    assert (ping.command, ping.batch_command) == ("batch", "ping")
    assert ping.redis_url == f"redis://{APP_USER}:app9c0ffee@redis:6379/0" and not ping.any_host


def test_the_image_is_built_once() -> None:
    """One service builds the image (`docker-compose build` builds it once); every redserve service runs it."""
    services = load(COMPOSE)["services"]
    builders = sorted(name for name, service in services.items() if "build" in service)
    assert builders == ["coordinator"] and services["coordinator"]["build"] == "."
    assert {services[name]["image"] for name in REDSERVE_SERVICES} == {"redserve:latest"}
    custom = load(COMPOSE, {"REDSERVE_IMAGE": "registry.example/redserve:1"})["services"]
    assert {custom[name]["image"] for name in REDSERVE_SERVICES} == {"registry.example/redserve:1"}


def test_engines_keep_the_cpu_kernels_in_a_volume() -> None:
    """g++ ships in the image; the engines build the kernels at first start into a named volume at the
    image's REDSERVE_KERNEL_CACHE_DIR, and nothing builds them at image build time (-march=native)."""
    compose = load(COMPOSE)
    dockerfile = (ROOT / "Dockerfile").read_text()
    cache_dir = re.search(r"REDSERVE_KERNEL_CACHE_DIR=(\S+)", dockerfile)[1]
    assert re.search(r"apt-get install [^\n]*\bg\+\+", dockerfile) and "worker.kernels" not in dockerfile
    assert re.search(r'chown redserve "\$REDSERVE_KERNEL_CACHE_DIR"', dockerfile)
    for name in ("engine-0", "engine-1"):
        assert f"kernel-cache:{cache_dir}" in compose["services"][name]["volumes"], name
        assert "./models:/models:ro" in compose["services"][name]["volumes"], name
    assert "kernel-cache" in compose["volumes"]


def test_every_service_shares_one_converted_model_cache() -> None:
    """A GGUF --model is converted once (common.model_source: a file lock, then an atomic rename) into the
    named volume at the image's REDSERVE_CACHE_DIR, which the API, the engines and the batch worker all
    mount, instead of once into each container's own home."""
    compose = load(COMPOSE)
    dockerfile = (ROOT / "Dockerfile").read_text()
    cache_dir = re.search(r"REDSERVE_CACHE_DIR=(\S+)", dockerfile)[1]
    assert re.search(r'chown redserve [^\n]*"\$REDSERVE_CACHE_DIR"', dockerfile)
    for name in REDSERVE_SERVICES:
        assert f"model-cache:{cache_dir}" in compose["services"][name]["volumes"], name
    assert "model-cache" in compose["volumes"]


def test_ignore_files_keep_secrets_and_models_out() -> None:
    gitignore = (ROOT / ".gitignore").read_text().split()
    dockerignore = (ROOT / ".dockerignore").read_text().split()
    assert ".env" in gitignore and "/models/" in gitignore
    assert ".env" in dockerignore and "models" in dockerignore


def _readme_compose_block() -> str:
    section = README.read_text().split("## docker compose\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)```", section, re.S)[1]


def _dotenv(path: Path) -> dict[str, str]:
    """KEY=VALUE lines, `# ...` comments (whole lines, or after a value and a space) dropped, as Compose reads them."""
    env = {}
    for line in path.read_text().splitlines():
        line = re.sub(r"(^|\s+)#.*", "", line).strip()
        if line:
            name, _, value = line.partition("=")
            env[name] = value
    return env


def test_the_readme_env_recipe_sets_the_required_secrets(tmp_path: Path) -> None:
    """The README's `.env` lines, run as given, write a 0600 file with which compose finds every required
    variable (without them `up` stops with "Missing mandatory value")."""
    setup = _readme_compose_block().split("\ndocker ", 1)[0]
    assert "chmod 600 .env" in setup
    done = subprocess.run(["bash", "-euc", setup], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    dotenv = tmp_path / ".env"
    assert dotenv.stat().st_mode & 0o777 == 0o600
    env = _dotenv(dotenv)
    for name in SECRETS:
        assert re.fullmatch(r"[0-9a-f]{64}", env[name]), name
    assert len({env[name] for name in SECRETS}) == len(SECRETS)
    services = load(COMPOSE, env, secrets=False)["services"]  # would raise MissingVariable
    assert services["api"]["environment"]["REDSERVE_API_KEY"] == env["REDSERVE_API_KEY"]
    assert services["engine-0"]["environment"]["REDSERVE_MODEL"] == "/models/Qwen2.5-0.5B-Instruct"
    assert "/srv/models:/models:ro" in services["api"]["volumes"]


def _typed_admin_commands() -> list[str]:
    """The `... exec redis sh -c '...redis-cli --user admin'` lines of the compose header and the README."""
    header = [line.lstrip("# ").split("  ")[0] for line in COMPOSE.read_text().splitlines()
              if line.startswith("#") and " exec redis " in line]
    readme = [line.split("  #")[0].strip() for line in _readme_compose_block().splitlines() if " exec redis " in line]
    assert header and readme
    return header + readme


def test_compose_variables_are_read_by_the_code() -> None:
    readers = ["redserve/cli.py", "api/options.py", "api/batch/cli.py", "api/batch/tasks.py"]
    source = "".join((ROOT / path).read_text() for path in readers)
    text = COMPOSE.read_text()
    environment = {name for service_name, service in load(COMPOSE)["services"].items()
                   for name in service.get("environment", {}) if service_name in REDSERVE_SERVICES}
    used = {name for name in environment if name.startswith("REDSERVE_")}
    used |= {m["name"] for m in _VAR.finditer(text) if m["name"] in environment}
    assert used, "the compose file sets no REDSERVE_* variable"
    unread = sorted(name for name in used if f'"{name}"' not in source)
    assert not unread, f"variables the code never reads: {unread}"


def test_compose_is_safe_to_expose() -> None:
    raw = yaml.safe_load(COMPOSE.read_text())
    services = load(COMPOSE)["services"]
    for name, service in services.items():
        assert service["restart"] == "unless-stopped", name
        assert service["init"] is True, name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert service["cap_drop"] == ["ALL"], name
        assert "privileged" not in service and "network_mode" not in service, name
        assert service["healthcheck"]["test"][0] == "CMD", name
        for spec in service.get("ports", []):  # host address:host port:container port
            assert spec.startswith("127.0.0.1:"), f"{name} publishes {spec} beyond loopback"
        for secret in SECRETS.values():
            assert secret not in json.dumps([service.get("command"), service.get("healthcheck")]), \
                f"{name}: a secret on a command line"
    assert "ports" not in services["redis"] and services["redis"]["user"] == "redis"
    assert raw["services"]["redis"]["image"].startswith("redis:7")
    opened = load(COMPOSE, {"REDSERVE_API_BIND": "0.0.0.0", "REDSERVE_API_PORT": "9000"})["services"]
    assert opened["api"]["ports"] == ["0.0.0.0:9000:8000"]
    for required in SECRETS:
        partial = {k: v for k, v in SECRETS.items() if k != required}
        with pytest.raises(MissingVariable, match=required):
            load(COMPOSE, partial, secrets=False)
        with pytest.raises(MissingVariable, match=required):
            load(COMPOSE, {**partial, required: ""}, secrets=False)
    # The redis service's ACL is the embedded server's: same application user and rules.
    assert f"user {APP_USER} on >$REDIS_APP_PASSWORD {APP_USER_RULES}" in services["redis"]["command"][-1]


def test_monitoring_profile_scrapes_the_api_with_the_key_from_the_environment() -> None:
    compose = load(COMPOSE)
    services = compose["services"]
    for name in MONITORING_SERVICES:
        assert services[name]["profiles"] == ["monitoring"], name
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            assert not source.startswith("./") or (ROOT / source).exists(), f"{name} mounts missing {source}"
    assert services["prometheus"]["image"].startswith("prom/prometheus")
    assert services["grafana"]["image"].startswith("grafana/grafana")
    assert "secrets" not in compose, "`secrets: environment:` needs Compose v2; docker-compose 1.29 rejects the file"
    scrape = yaml.safe_load((MONITORING / "prometheus" / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["static_configs"][0]["targets"] == ["api:8000"] and scrape["metrics_path"] == "/metrics"
    prometheus = services["prometheus"]
    key_file = scrape["authorization"]["credentials_file"]
    start = prometheus["entrypoint"][-1]
    assert f'> {key_file}' in start and "umask 077" in start and "exec /bin/prometheus" in start
    assert prometheus["environment"]["REDSERVE_API_KEY"] == SECRETS["REDSERVE_API_KEY"]
    grafana = services["grafana"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == ""  # unset here: its entrypoint refuses
    assert "exit 1" in grafana["entrypoint"][-1] and "exec /run.sh" in grafana["entrypoint"][-1]
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    dashboard = json.loads((MONITORING / "grafana" / "redserve-dashboard.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {datasource["datasources"][0]["uid"]}
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/redserve.yml").read_text())
    assert any(v.endswith(":" + provider["providers"][0]["options"]["path"] + "/redserve-dashboard.json:ro")
               for v in grafana["volumes"])


def test_compose_config_validates_when_docker_compose_is_installed() -> None:
    """`docker-compose config` (Debian's 1.29 or Compose v2) accepts the file, monitoring profile included."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed")
    env = {**os.environ, **SECRETS}
    for profile in ([], ["--profile", "dp2"], ["--profile", "monitoring"]):
        out = subprocess.run([binary, "-f", str(COMPOSE), *profile, "config", "-q"], capture_output=True, text=True,
                             env=env, timeout=60)
        assert out.returncode == 0, out.stderr


def test_gpu_override_and_dockerfile() -> None:
    override = load(GPU_OVERRIDE)
    assert set(override["services"]) <= REDSERVE_SERVICES
    for service in override["services"].values():
        assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert service["environment"]["CUDA_VISIBLE_DEVICES"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11", dockerfile, re.M) and re.search(r'pip install "?\.(\[gguf\])?"?', dockerfile)
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.findall(r'"(\w+)\*"', re.search(r"packages = \{ find = \{ include = \[(.*?)\]", pyproject).group(1))
    assert {"api", "broker", "coordinator", "engine", "worker", "redserve"} <= set(packages)
    for package in packages:  # every package pip installs is in the image
        assert f"COPY {package} ./{package}" in dockerfile
    assert 'redserve = "redserve.cli:main"' in pyproject


# ------------------------------------------------------------------------------------ the stack, locally

def local_argv(argv: list[str], port: int) -> list[str]:
    """A service command as a local process: this interpreter, the API on 127.0.0.1:`port`."""
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    out = [sys.executable, "-m", "redserve.cli", *argv[1:]]
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port))):
        if flag in out:
            out[out.index(flag) + 1] = value
    return out


def start_compose_redis(procs: Procs, service: dict[str, Any], tmp_path: Path) -> str:
    """The redis service's own command (``sh -c 'exec redis-server - <<EOF ...'``) on this machine's
    Redis-compatible server, on 127.0.0.1 at a free port; the application user's URL."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "redis-server").symlink_to(redis_server_path())
    port = free_port()
    env = {**service["environment"], "PATH": f"{shim}:{os.environ['PATH']}", "REDIS_PORT": str(port),
           "REDIS_BIND": "127.0.0.1", "REDIS_MAXMEMORY": "256mb"}
    procs.start("redis", service["command"], env=env)
    url = f"redis://{APP_USER}:{SECRETS['REDSERVE_REDIS_PASSWORD']}@127.0.0.1:{port}/0"
    wait_for(lambda: _pings(url), 30, "the redis service", watch=tuple(procs.procs))
    return url


def _pings(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_timeout=2) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def check_redis_acl(port_url: str) -> None:
    """The application user works but cannot reconfigure or wipe; nobody gets in without a password."""
    app = redis.Redis.from_url(port_url)
    assert app.set("compose-acl-probe", "1") and app.delete("compose-acl-probe") == 1
    for command in (("FLUSHALL",), ("CONFIG", "SET", "dir", "/tmp"), ("SHUTDOWN",), ("FLUSHDB",),
                    ("ACL", "SETUSER", "intruder", "on", ">x", "+@all")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            app.execute_command(*command)
    anonymous = port_url.replace(f"{APP_USER}:{SECRETS['REDSERVE_REDIS_PASSWORD']}@", "")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(anonymous).ping()
    admin_url = port_url.replace(f"{APP_USER}:{SECRETS['REDSERVE_REDIS_PASSWORD']}",
                                 f"admin:{SECRETS['REDSERVE_REDIS_ADMIN_PASSWORD']}")
    assert redis.Redis.from_url(admin_url).config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}


def healthcheck(service: dict[str, Any], env: dict[str, str], api_port: int = 8000) -> int:
    """Exit code of the service's healthcheck command run locally (the API's on `api_port`)."""
    argv = [arg.replace("127.0.0.1:8000/", f"127.0.0.1:{api_port}/")
            for arg in local_argv(service["healthcheck"]["test"][1:], api_port)]
    return subprocess.run(argv, env={**os.environ, **env}, capture_output=True, timeout=60).returncode


def test_compose_commands_serve_a_request_and_a_batch(tiny_llama_dir: str, tmp_path: Path) -> None:
    host_env = {"REDSERVE_MODEL": tiny_llama_dir, "REDSERVE_DTYPE": "float32", "REDSERVE_DEVICE": "cpu",
                "REDSERVE_API_WORKERS": "1", "REDSERVE_BATCH_CONCURRENCY": "1",
                "REDSERVE_KEY_PREFIX": f"c{uuid.uuid4().hex[:8]}"}
    services = load(COMPOSE, host_env)["services"]
    procs = Procs(tmp_path)
    port = free_port()
    try:
        redis_url = start_compose_redis(procs, services["redis"], tmp_path)
        check_redis_acl(redis_url)
        for typed in _typed_admin_commands():
            assert run_typed_admin_command(typed, services["redis"], redis_url, tmp_path) == "admin", typed
        local = {"REDSERVE_REDIS_URL": redis_url, "REDSERVE_STATE_DIR": str(tmp_path)}
        engine_env = {**services["engine-0"]["environment"], **local}
        assert healthcheck(services["engine-0"], engine_env) == 1
        keys = RedisKeys(host_env["REDSERVE_KEY_PREFIX"])
        with redis.Redis.from_url(redis_url) as r:  # an engine's healthcheck is its readiness: alive is not enough
            r.set(keys.engine_alive("0"), "probe", ex=60)
            r.hset(keys.engine("0"), "state", "starting")
            assert healthcheck(services["engine-0"], engine_env) == 1
            r.hset(keys.engine("0"), "state", "ready")
            assert healthcheck(services["engine-0"], engine_env) == 0
            r.delete(keys.engine_alive("0"), keys.engine("0"))
        assert healthcheck(services["batch-worker"], {**services["batch-worker"]["environment"], **local}) == 1
        started = {}
        base = f"http://127.0.0.1:{port}"
        for name in ("coordinator", "api", "batch-worker", "engine-0"):
            env = {**services[name]["environment"], **local}
            started[name] = procs.start(name, local_argv(services[name]["command"], port), env=env)
            if name == "api":  # live with no engine (no auth either), while its readiness says 503
                wait_for(lambda: _status(base, "/livez") == 200, 60, "the API's /livez", watch=(started[name],))
                assert _status(base, "/health") == 503 and _status(base, "/readyz") == 503
                assert healthcheck(services["api"], env, port) == 0
        watch = tuple(started.values())
        wait_for(lambda: engine_ready(redis_url, keys), 120, "the engine", watch=watch)
        wait_for(lambda: _healthy(base), 60, "the API", watch=watch)
        assert _status(base, "/readyz") == 200 and _status(base, "/livez") == 200
        for name, healthy in (("engine-0", 0), ("engine-1", 1), ("coordinator", 0), ("api", 0),
                              ("batch-worker", 0)):
            env = {**services[name]["environment"], **local}
            wait_for(lambda s=services[name], e=env, h=healthy: healthcheck(s, e, port) == h, 30,
                     f"{name}'s healthcheck to exit {healthy}")
        env = {**services["batch-worker"]["environment"], **local}
        started_at = time.monotonic()
        assert healthcheck(services["batch-worker"], env) == 0
        assert time.monotonic() - started_at < 4.0, "the batch ping waited out its timeout instead of its answer"

        auth = {"Authorization": f"Bearer {SECRETS['REDSERVE_API_KEY']}"}
        body = {"model": "tiny-llama", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
        assert requests.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 401
        http = requests.post(f"{base}/v1/completions", json=body, headers=auth, timeout=60).json()
        chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                "temperature": 0}
        http_chat = requests.post(f"{base}/v1/chat/completions", json=chat, headers=auth, timeout=60).json()

        src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        items = [("a", "/v1/completions", body), ("b", "/v1/chat/completions", chat)]
        src.write_text("".join(json.dumps({"custom_id": c, "method": "POST", "url": u, "body": b}) + "\n"
                               for c, u, b in items))
        env = {**os.environ, **services["batch-worker"]["environment"], "REDSERVE_REDIS_URL": redis_url}
        submit = [sys.executable, "-m", "redserve.cli", "batch", "submit", str(src), "--output", str(out)]
        done = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert [line["custom_id"] for line in lines] == ["a", "b"]
        for line, expected in zip(lines, (http, http_chat), strict=True):
            assert line["response"]["status_code"] == 200
            assert _comparable(line["response"]["body"]) == _comparable(expected)

        assert title(started["engine-0"].pid).startswith("redserve-engine-0")
        assert title(started["api"].pid).startswith("redserve-api")
        assert title(started["batch-worker"].pid).startswith("redserve-batch")
        assert title(started["coordinator"].pid).startswith("redserve-coordinator")
    finally:
        procs.close()


def _healthy(base: str) -> bool:
    return _status(base, "/health") == 200


def _status(base: str, path: str) -> int | None:
    """The status code of an unauthenticated GET, or None if nothing answers."""
    try:
        return requests.get(f"{base}{path}", timeout=2).status_code
    except requests.RequestException:
        return None


def run_typed_admin_command(typed: str, redis_service: dict[str, Any], redis_url: str, tmp_path: Path) -> str:
    """`typed` (``docker compose exec redis sh -c '...'``) run by bash as a user types it, `docker` standing in
    for Compose: the rest runs with the redis service's environment, its `redis-cli` pointed at the local
    server; ``ACL WHOAMI`` on stdin. The user redis-cli logged in as (its output)."""
    shim = tmp_path / "cli-bin"
    shim.mkdir(exist_ok=True)
    port = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"]
    wrapper = shim / "redis-cli"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(redis_cli_path())} -p {port} \"$@\"\n")
    wrapper.chmod(0o755)
    container_env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in redis_service["environment"].items())
    compose = (f'docker() {{ [ "$1 $2 $3" = "compose exec redis" ] && shift 3 && '
               f'env -i PATH={shim}:/usr/bin:/bin {container_env} "$@"; }}\n'
               f'docker-compose() {{ docker compose "$@"; }}\n')
    done = subprocess.run(["bash", "-c", compose + typed], input="ACL WHOAMI\n", capture_output=True, text=True,
                          timeout=30)
    return (done.stdout + done.stderr).strip()


def _comparable(body: dict[str, Any]) -> dict[str, Any]:
    """A response body without what differs between two identical requests (id, timestamp)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_the_admin_command_would_fail_with_compose_escapes(tmp_path: Path) -> None:
    """`$$` is Compose's escape inside the YAML only: typed in a shell it is the shell's PID (WRONGPASS)."""
    services = load(COMPOSE)["services"]
    procs = Procs(tmp_path)
    try:
        redis_url = start_compose_redis(procs, services["redis"], tmp_path)
        typed = _typed_admin_commands()[0]
        assert run_typed_admin_command(typed, services["redis"], redis_url, tmp_path) == "admin"
        escaped = typed.replace("$REDIS_ADMIN_PASSWORD", "$$REDIS_ADMIN_PASSWORD")
        assert "WRONGPASS" in run_typed_admin_command(escaped, services["redis"], redis_url, tmp_path)
    finally:
        procs.close()


@pytest.mark.parametrize("service", ["engine-0", "api", "batch-worker"])
def test_a_missing_model_directory_is_one_error_line(service: str) -> None:
    """A service whose REDSERVE_MODEL does not exist exits non-zero with one line on stderr, no traceback."""
    compose = load(COMPOSE, {"REDSERVE_MODEL": "/nonexistent/model"})["services"][service]
    env = {**os.environ, **compose["environment"], "REDSERVE_REDIS_URL": "redis://127.0.0.1:9/0"}
    done = subprocess.run(local_argv(compose["command"], free_port()), env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "/nonexistent/model" in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_serve_with_a_missing_model_is_one_error_line() -> None:
    done = subprocess.run([sys.executable, "-m", "redserve.cli", "serve", "--model", "/nonexistent/model"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == "redserve serve: --model '/nonexistent/model' is not a directory or a GGUF file"
