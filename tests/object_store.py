"""An S3 server on loopback (moto's) for the tests that read prompts from object storage.

``s3_server()`` yields the environment a Ray job needs to reach it (what a user
passes with ``nnsight-ray submit --env`` for an S3-compatible store such as
MinIO: ``AWS_ENDPOINT_URL`` and the credentials) and a ``pyarrow`` filesystem
for the test to put files in. pyarrow (which Ray Data reads S3 with) honours
``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def s3_server(bucket: str = "prompts") -> Iterator[tuple[dict[str, str], object]]:
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
        filesystem = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], access_key="test",
                                       secret_key="test", region="us-east-1", allow_bucket_creation=True)
        filesystem.create_dir(bucket)
        yield env, filesystem
    finally:
        server.stop()
