"""Memory, decided before anything is allocated: the planner's estimates (`plan`), admission of one request
(`admission`) and which models stay on the device (`residency`). Pure arithmetic over configs and shapes
(XLA's own analysis of the compiled programs, for comparison, is `klein.aot.compiled`). May import
what is below it: `klein.io` (abstract models), `klein.models`, `klein.sharding`, `klein.dtypes`,
`klein.errors`; never `klein.request` (a request reaches the planner as numbers, its `plan.Workload`:
`klein.request.resolve.Resolved.workload`), the pipeline nor a front end.
"""
