-- Placement (schema 33; docs/sql-api.md, "Placement"): a run that only a host with the labels zone=a and
-- disk=ssd may run, whose retry after any failed attempt prefers another host than the one it failed on.
SELECT unitvisor.submit_run(
    argv              => ARRAY['/opt/jobs/bin/export'],
    max_attempts      => 3,
    host_labels       => '{"zone": "a", "disk": "ssd"}',
    avoid_failed_host => true) AS run_id \gset

SELECT host_labels, avoid_failed_host FROM unitvisor.runs WHERE id = :'run_id';

-- The hosts that have those labels (none is registered in this database), and why the run waits, in
-- the words `unitvisor submit` warns with.
SELECT h.id, unitvisor.host_labels(h) AS labels FROM unitvisor.hosts h
WHERE unitvisor.host_labels(h) @> '{"zone": "a", "disk": "ssd"}';
SELECT reason FROM unitvisor.refusals_now(ARRAY[:'run_id']::uuid[]);

-- A label's value that is not a string is refused, by name.
SELECT unitvisor.submit_run(ARRAY['/opt/jobs/bin/export'], host_labels => '{"zone": 1}');

SELECT state, changed FROM unitvisor.cancel_run(:'run_id');
