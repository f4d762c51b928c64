"""After a crash: `recover` verifies, aborts in-doubt appends, rebuilds live K/V by
re-executing journaled appends with the worker and finishes every request; the crash-test
harness kills real workers and proves nothing acknowledged was lost."""
