"""Looking at programs without running them: collectives in compiled HLO (`hlo`), a TPU
roofline (`roofline`), `plan`'s compile (`compile`) and its report, and timing for `bench`."""
