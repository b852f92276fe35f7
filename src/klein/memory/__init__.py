"""Memory, decided before anything is allocated: the planner's estimates (`plan`), admission of one request
(`admission`) and which models stay on the device (`residency`). Pure arithmetic over configs and shapes
(XLA's own analysis of the compiled programs, for comparison, is `klein.aot.compiled`). May import
what is below it (`io`: abstract models; `models`, `sharding`, `dtypes`, `errors`); no request, which
reaches the planner as numbers (`plan.Workload`), nor anything above.
"""
