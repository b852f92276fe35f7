"""Memory, decided before anything is allocated: the planner's estimates (`plan`), admission of one request
(`admission`) and which models stay on the device (`residency`). Pure arithmetic over configs and shapes
(XLA's own analysis of the compiled programs, for comparison, is `klein.aot.compiled`). May import
`klein.request`, `klein.models`, `klein.io` (abstract models), `klein.sharding`, `klein.errors`; never the
pipeline nor a front end.
"""
