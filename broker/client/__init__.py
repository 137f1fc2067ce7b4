"""The client side of the broker (API processes, Celery workers): `BrokerClient` and its parts.

Imports run one way inside: `client` assembles `listener`, `liveness` (with `migration`), `sender` and
`request_handle` around one `in_flight` table; each part takes only the pieces it uses, and none imports
`client`. `mailbox` and `request_resume` are plain data and pure functions.
"""

from broker.client.client import BrokerClient, ClientSettings, default_client_id
from broker.client.request_handle import RequestHandle

__all__ = ["BrokerClient", "ClientSettings", "RequestHandle", "default_client_id"]
