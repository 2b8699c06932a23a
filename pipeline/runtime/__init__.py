"""How any worker runs, whatever it does: the runner (decode, dead letters, retries, commit order, metrics), the
transports (Kafka group and assign inputs, the Kafka output), stored positions, the worker context and launch, blobs
and durable files, and the harness that drives a worker without a broker (`pipeline.runtime.harness`).

Everything above builds on it; it imports nothing of the domain packages (tests/unit/test_import_flow.py).
"""
