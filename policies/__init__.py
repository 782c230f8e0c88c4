"""Decisions as data: routing, prefill batching and decode admission. Policies never touch the clock."""
