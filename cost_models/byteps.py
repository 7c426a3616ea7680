"""The former name of :mod:`cost_models.byteps_traffic`, kept for the modules that still import it by this name."""
from cost_models.byteps_traffic import (allreduce_bytes, bytes_per_server, bytes_per_worker, gain_over_allreduce,
                                        predict, server_share, split_bucket, worker_share)

__all__ = ["server_share", "worker_share", "split_bucket", "bytes_per_worker", "bytes_per_server", "allreduce_bytes",
           "gain_over_allreduce", "predict"]
