"""A Celery app for tests/test_celery_cluster.py: the batch app's broker and result backend settings for the
cluster URL in ``REDSERVE_TEST_CLUSTER_URL`` (the same calls `api.batch.tasks.configure` makes), and one task."""

from __future__ import annotations

import os

from celery import Celery

from api.batch.celery_redis import RETRY_SETTINGS, celery_redis_settings, celery_transport_options
from broker.keys import RedisKeys

PREFIX = RedisKeys().celery()
URL = os.environ["REDSERVE_TEST_CLUSTER_URL"]
OPTIONS = {"global_keyprefix": PREFIX, **celery_transport_options(URL, route_key=PREFIX)}

app = Celery("redserve.test-cluster", set_as_current=False)
app.conf.update(**celery_redis_settings(URL, route_key=PREFIX), broker_transport_options=OPTIONS,
                result_backend_transport_options=OPTIONS, broker_connection_retry_on_startup=True,
                **RETRY_SETTINGS,
                task_serializer="json", result_serializer="json", accept_content=["json"],
                task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
                task_default_queue="cluster-test")


@app.task(name="cluster_test.double")
def double(x: int) -> dict:
    return {"value": 2 * x, "pid": os.getpid()}
