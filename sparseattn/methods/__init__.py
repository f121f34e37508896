"""The five papers' methods, one package each, built from the core and importing nothing else.

* :mod:`.yun` — Yun et al. (NeurIPS 2020), O(n) connections are expressive enough:
  Assumptions 1–2 and the contextual mapping (``sparseattn analyze``);
* :mod:`.sparsebert` — Shi et al. (ICML 2021), SparseBERT: learned attention masks, no diagonal
  (``sparseattn dam``);
* :mod:`.mca` — Kim & Ko (AAAI 2022), MCA: Monte-Carlo value products (``sparseattn mca``);
* :mod:`.likhosherstov` — Likhosherstov, Choromanski & Weller (AAAI 2023): what one attention
  matrix can express (``sparseattn expressivity``);
* :mod:`.sparsefinder` — Treviso et al. (2022), Sparsefinder: predict the α-entmax graph
  (``sparseattn sparsefinder``).

The commands are the lab's (:mod:`sparseattn.lab`). Every package has one shape: its ``__init__``
names the paper, the equations it implements and its public functions, and re-exports them; the
modules beside it hold the work. Importing this package imports none of them (``import
sparseattn.methods.mca`` loads MCA alone). The packages do not import one another (an import-linter
contract).
"""
