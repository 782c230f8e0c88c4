"""Requests in, results out: record schemas, traces, workloads, loaders and the replay client."""

from traces.schema import (RECORD_COLUMNS, Request, RequestRecord, Status, iter_records,
                           read_records, records_frame, write_records)
from traces.trace import Trace

__all__ = ["RECORD_COLUMNS", "Request", "RequestRecord", "Status", "Trace", "iter_records",
           "read_records", "records_frame", "write_records"]
