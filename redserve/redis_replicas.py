"""A replicated embedded Redis: a primary, N replicas and three sentinels (``redserve serve --redis-replicas N``).

Rules:
- Every node is an `EmbeddedRedis` (the same valkey-server binary), on 127.0.0.1, with the same ACL users and
  passwords (`redserve.redis_conf`). Names: ``redis-0`` .. ``redis-N`` for the data nodes (``redis-0`` starts
  as the primary) and ``sentinel-0`` .. ``sentinel-2``.
- `start` starts the primary, then the replicas, then the sentinels, and returns once every replica's link
  is up and every sentinel knows every replica and the two other sentinels: from then on a dead primary is
  replaced (quorum 2, `redserve.redis_conf.SentinelConfig` for the timings).
- `url` / `admin_url`: ``redis+sentinel://`` URLs over the three sentinels (`broker.connection`), as the
  application user / the admin. Every redserve process finds the primary through them.
- A dead node is started again on the same port (`prepare_restart`, then `EmbeddedRedis.restart`): a data
  node always comes back as a replica of the primary the sentinels name now, never as an empty primary
  (its replicas would copy the empty data set); while the sentinels still name the dead node itself (no
  failover yet) `prepare_restart` says wait. A sentinel comes back watching the current primary.
- `describe()` lists each node (name, role, address, pid) for the stack file and ``redserve status``.
"""

from __future__ import annotations

import logging
import time

import redis

from broker.connection import sentinel_url
from redserve.redis_conf import ADMIN_USER, APP_USER, MASTER_NAME
from redserve.redis_server import EmbeddedRedis, new_passwords

logger = logging.getLogger(__name__)

SENTINELS = 3


class ReplicatedRedis:
    """The nodes of one replicated embedded Redis; see the module rules."""

    def __init__(self, replicas: int, startup_timeout: float = 30.0) -> None:
        if replicas < 1:
            raise ValueError(f"--redis-replicas must be >= 1 for a replicated Redis, got {replicas}")
        self.passwords = new_passwords()
        self.startup_timeout = startup_timeout
        self.data = {f"redis-{i}": EmbeddedRedis(passwords=self.passwords) for i in range(replicas + 1)}
        self.sentinels: dict[str, EmbeddedRedis] = {}

    @property
    def nodes(self) -> dict[str, EmbeddedRedis]:
        return {**self.data, **self.sentinels}

    def start(self) -> ReplicatedRedis:
        try:
            primary, *replicas = self.data.values()
            primary.start()
            for node in replicas:
                node.replica_of = primary.address
                node.start()
            self.sentinels = {f"sentinel-{i}": EmbeddedRedis(passwords=self.passwords, sentinel_of=primary.address)
                              for i in range(SENTINELS)}
            for node in self.sentinels.values():
                node.start()
            self._wait_settled()
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in [*self.sentinels.values(), *reversed(self.data.values())]:
            node.stop()

    def url_as(self, user: str) -> str:
        return sentinel_url([node.address for node in self.sentinels.values()], MASTER_NAME, user,
                            self.passwords[user])

    @property
    def url(self) -> str:
        return self.url_as(APP_USER)

    @property
    def admin_url(self) -> str:
        return self.url_as(ADMIN_USER)

    def primary_address(self) -> tuple[str, int] | None:
        """The primary the first sentinel that answers names, or None if none answers."""
        for node in self.sentinels.values():
            if not node.running:
                continue
            client = self._admin_client(node)
            try:
                host, port = client.sentinel_get_master_addr_by_name(MASTER_NAME)
                return (host.decode() if isinstance(host, bytes) else host), int(port)
            except (redis.RedisError, TypeError, ValueError):
                continue
            finally:
                client.close()
        return None

    def prepare_restart(self, name: str) -> bool:
        """Set dead node `name` up to come back in the role it must have now; False: not yet (see the rules)."""
        node = self.nodes[name]
        primary = self.primary_address()
        if primary is None:
            return False
        if name in self.sentinels:
            node.sentinel_of = primary
            return True
        if primary == node.address:
            return False
        node.replica_of = primary
        return True

    def describe(self) -> list[dict]:
        primary = self.primary_address()
        out = []
        for name, node in self.nodes.items():
            role = "sentinel" if name in self.sentinels else "primary" if node.port and primary == node.address \
                else "replica"
            out.append({"name": name, "role": role, "address": f"127.0.0.1:{node.port}", "pid": node.pid,
                        "running": node.running})
        return out

    def _wait_settled(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        want_replicas = len(self.data) - 1
        while not self._settled(want_replicas):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replicated Redis did not settle within {self.startup_timeout:.0f} s: replicas "
                                   "not linked, or sentinels that do not see each other (see their logs)")
            time.sleep(0.1)

    def _settled(self, want_replicas: int) -> bool:
        for node in self.sentinels.values():
            client = self._admin_client(node)
            try:
                state = client.sentinel_master(MASTER_NAME)
            except redis.RedisError:
                return False
            finally:
                client.close()
            if int(state.get("num-slaves", 0)) < want_replicas or int(state.get("num-other-sentinels", 0)) < 2:
                return False
        return all(self._linked(node) for node in list(self.data.values())[1:])

    def _linked(self, node: EmbeddedRedis) -> bool:
        client = self._admin_client(node)
        try:
            return client.info("replication").get("master_link_status") == "up"
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _admin_client(self, node: EmbeddedRedis) -> redis.Redis:
        host, port = node.address
        return redis.Redis(host=host, port=port, username=ADMIN_USER, password=self.passwords[ADMIN_USER],
                           socket_timeout=1.0, socket_connect_timeout=1.0, protocol=2, decode_responses=True)
