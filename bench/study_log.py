"""The studies' logs: for each study of bench/studies.py, dated entries of what was run and what it found. A figure
is a placeholder (bench/studies.py names them) that the report fills from the result file it names; a figure with
no result file says so. Add an entry when a study's files change; superseded rows stay in `git log -p bench/results/`.
"""

LOGS: dict[str, list[tuple[str, str]]] = {
    "ratio": [
        ("2026-12-05",
         "How far the taper goes is the largest lever measured on a conversion's cost, far larger than any neuron "
         "choice or heal setting. SmolLM2-135M (token-mask Fisher, the default's calibration blocks), out of domain "
         "right after conversion and after 24,576 / 196,608 heal tokens: 1.5/0.5 (widths {widths:fisher_token}) "
         "{ood:fisher_token}, {ood:heal_fisher_token@24576}, {ood:heal_fisher_token@196608}; 1.4/0.6 "
         "({widths:ratio_140}) {ood:ratio_140}, {ood:heal_ratio_140@24576}, {ood:heal_ratio_140@196608}; 1.25/0.75 "
         "({widths:ratio_125}) {ood:ratio_125}, {ood:heal_ratio_125@24576}, {ood:heal_ratio_125@196608}. Most of "
         "each heal's gain comes in its first 24,576 tokens, so the ratio sets the level; past 196,608 the curves "
         "are flat (1.4/0.6: {ood:heal_ratio_140@393216} at 393,216)."),
        ("2026-12-05",
         "The conversion's targets are an OOD ratio of at most 1.30 right after conversion, 1.25 after 25k heal "
         "tokens and 1.15 within one hour of CPU. On the default's calibration draw 1.4/0.6 meets all three at two conversion seeds (seed "
         "0: {cpu:ratio_140} CPU s of conversion, {ood:heal_ratio_140@196608} after {cpu:heal_ratio_140@196608} CPU s "
         "of heal; seed 1, growth noise and Fisher targets drawn anew on the same blocks: {ood:ratio_140_seed1} "
         "converted, {ood:heal_ratio_140_seed1@24576} and {ood:heal_ratio_140_seed1@196608} healed), but not on a "
         "second draw: with every seed 1, as `tlm-convert --seed 1` sets them, {ood:ratio_140_cal1} converted and "
         "{ood:heal_ratio_140_cal1@196608} after 196,608 tokens, {ood:heal_ratio_140_cal1_hs0@196608} when healed in "
         "seed 0's data order: at 1.4/0.6 the 1.15 target sits inside the spread of the calibration draw (the heal's "
         "order a part of it). 1.25/0.75 meets the targets before any heal."),
        ("2026-12-05",
         "Gemma 3 270M: 1.4/0.6 ({widths:gemma_ratio_140}) {ood:gemma_ratio_140} converted, "
         "{ood:heal_gemma_ratio_140@24576} after 24,576 heal tokens; 1.25/0.75 ({widths:gemma_ratio_125}) "
         "{ood:gemma_ratio_125}, {ood:heal_gemma_ratio_125@24576}; 1.5/0.5 {ood:gemma_fisher_token}, "
         "{ood:heal_gemma_fisher_token@24576}."),
        ("2026-12-05",
         "What a gentler taper gives up is the taper's gain. From scratch, the paper's 440M schedule x ratio sweep "
         "(arXiv 2606.23670) credits cosine 1.25/0.75 with a perplexity gain of 1.10 against 1.5/0.5's 1.84 (the "
         "paper's figures, a cell our design notes could not verify). At CPU scale the converted model's lead over "
         "continuing is within the noise at every ratio (the compare study, 90 + 270 steps: 1.5/0.5 "
         "{pair:compare:cpu-ratio150/90+270/converted-cpt}; 1.4/0.6 {pair:compare:cpu-ratio140/90+270/converted-cpt}; "
         "1.25/0.75 {pair:compare:cpu-ratio125/90+270/converted-cpt}). The default stays the paper's 1.5/0.5: which "
         "taper a user converts to is the owner's call."),
    ],
    "measured-taper": [
        ("2026-12-03",
         "`--schedule measured-taper` takes the widths from the source: the Fisher pre-pass scores every MLP neuron, "
         "each layer's share of the model's top half of neurons is its profile, and the widths follow the profile at "
         "the same parameter count, between the `--ratio` bounds and non-increasing with depth (`measured` drops the "
         "last condition). It costs nothing over the default: the pre-pass that ranks the neurons gives the profile. "
         "With the OBS ranking of the day, SmolLM2-135M healed from {ood:heal_measured_taper@0} to "
         "{ood:heal_measured_taper@24576} in 24,576 tokens and {ood:heal_measured_taper@393216} in 393,216, against "
         "cosine's {ood:obs_default} and {ood:heal_obs@24576}. Gemma 3 270M with the sequence-score Fisher ranking "
         "of the day: {ood:gemma_measured_taper_fisher} converted, {ood:heal_gemma_measured_taper_fisher@24576} "
         "healed, against cosine's {ood:gemma_fisher} and {ood:heal_gemma_fisher@24576}."),
        ("2026-12-03",
         "At CPU scale a measured-taper conversion then trained beats continuing the uniform model (the compare "
         "study: {pair:compare:cpu-measured/90+270/converted-cpt})."),
        ("2026-12-04",
         "With the token-mask Fisher ranking, SmolLM2-135M keeps its late layers much wider than cosine (widths "
         "{widths:measured_taper_fisher_token} against {widths:fisher_token}) and loses far less: "
         "{ood:measured_taper_fisher_token} converted, {ood:heal_measured_taper_fisher_token@24576} after 24,576 heal "
         "tokens, against cosine's {ood:fisher_token} and {ood:heal_fisher_token@24576}: the best conversion "
         "measured. It is not the default schedule: it is not the shape the paper measured from scratch, and whether "
         "its smaller taper keeps the taper's gain over long training is not measured."),
    ],
    "calibration-size": [
        ("2026-12-04",
         "Twice the default's calibration text (`--calibration-tokens 131072`: 256 blocks, half of them the source's "
         "own samples) converted SmolLM2-135M to {ood:fisher_token_cal131k} / {ood:fisher_token_cal131k_seed1} / "
         "{ood:fisher_token_cal131k_seed2} with the samples drawn at seeds 0 / 1 / 2, and healed in 24,576 tokens to "
         "{ood:heal_fisher_token_cal131k@24576} / {ood:heal_fisher_token_cal131k_seed1@24576} / "
         "{ood:heal_fisher_token_cal131k_seed2@24576}. Three draws of the default's 65,536 tokens (the default's "
         "own, and the seed-0 131,072-token draw's even and odd blocks) gave {ood:fisher_token} / "
         "{ood:fisher_token_cal131k_half} / {ood:fisher_token_cal131k_odd} and {ood:heal_fisher_token@24576} / "
         "{ood:heal_fisher_token_cal131k_half@24576} / {ood:heal_fisher_token_cal131k_odd@24576}. Means over the "
         "draws: {gmean:fisher_token_cal131k,fisher_token_cal131k_seed1,fisher_token_cal131k_seed2} against "
         "{gmean:fisher_token,fisher_token_cal131k_half,fisher_token_cal131k_odd} converted, "
         "{gmean:heal_fisher_token_cal131k,heal_fisher_token_cal131k_seed1,heal_fisher_token_cal131k_seed2@24576} "
         "against {gmean:heal_fisher_token,heal_fisher_token_cal131k_half,heal_fisher_token_cal131k_odd@24576} "
         "healed: the draws of 65,536 tokens spread about as wide as the two means lie apart."),
        ("2026-12-04",
         "The seed-0 131,072-token conversion healed 196,608 tokens reaches {ood:heal_fisher_token_cal131k@196608} "
         "(the default's {ood:heal_fisher_token@196608}). The cost is the conversion's: {cpu:fisher_token_cal131k} "
         "CPU s against the default's {cpu:fisher_token} on one thread (the samples' drawing apart), and a larger "
         "peak memory (each file's `machine` note). The default stays 65,536 tokens: the gain does not yet pay for a "
         "longer, larger conversion of every checkpoint; `--calibration-tokens 131072` is the choice for the best "
         "conversion."),
    ],
    "neuron-ranking": [
        ("2026-12-02",
         "Structured Optimal Brain Surgeon (`importance=obs`: greedily drop the neuron whose removal costs its "
         "layer's output least after a least-squares compensation) was the default: SmolLM2-135M {ood:obs_default} "
         "right after conversion, {ood:heal_obs@24576} after 24,576 heal tokens (the heal's absolute rate of its "
         "day)."),
        ("2026-12-03",
         "The Fisher pre-pass ranks by the whole model's output instead: the diagonal Fisher of the model's own "
         "next-token distribution with respect to a mask on each neuron, from one backward pass over the calibration "
         "tokens before the layer loop (about three forward passes' cost; its backward stops at the first layer "
         "that does not grow). It measured better on both sources and became the default. Today's token-mask score: "
         "SmolLM2-135M {ood:fisher_token} against OBS's {ood:obs_default} right after conversion, "
         "{ood:heal_fisher_token@24576} against {ood:heal_obs@24576} after 24,576 heal tokens; Gemma 3 270M "
         "{ood:gemma_fisher_token} against {ood:gemma_obs_default}, and {ood:heal_gemma_fisher_token@24576} against "
         "{ood:heal_gemma_relative@24576} healed (an OBS conversion of the day, healed at the relative rate). OBS's "
         "costs weighted by the Fisher scores (`importance=fisher_obs`) fell between the two, and a pre-pass over 32 "
         "of the 128 calibration blocks lost the gain (fisher_obs.json, fisher_32.json: git history)."),
    ],
    "fisher-estimate": [
        ("2026-12-03",
         "The pre-pass's targets are drawn (y ~ p(. | x)), so each score is a sampled estimate. A score was one "
         "square a sequence: the mask gradient summed over the sequence's positions, then squared "
         "(`fisher_mask=sequence`, the default of the day). SmolLM2-135M converted so to {ood:fisher} and healed to "
         "{ood:heal_fisher@24576} in 24,576 tokens; Gemma 3 270M to {ood:gemma_fisher} and "
         "{ood:heal_gemma_fisher@24576}."),
        ("2026-12-04",
         "With the same calibration blocks, the conversion's seed alone (its Fisher targets drawn anew) moved the "
         "sequence score's result more than any other setting measured: {ood:fisher} / {ood:fisher_seed1} / "
         "{ood:fisher_seed2} converted at seeds 0 / 1 / 2, {ood:heal_fisher@24576} / {ood:heal_fisher_seed1@24576} / "
         "{ood:heal_fisher_seed2@24576} healed. `fisher_draws=K` averages K draws, one backward pass each: two draws "
         "gave {gmean:fisher_draws2,fisher_draws2_seed1,fisher_draws2_seed2} converted and "
         "{gmean:heal_fisher_draws2,heal_fisher_draws2_seed1,heal_fisher_draws2_seed2@24576} healed over the three "
         "seeds (one draw: {gmean:fisher,fisher_seed1,fisher_seed2} and "
         "{gmean:heal_fisher,heal_fisher_seed1,heal_fisher_seed2@24576}); eight at seed 0 {ood:fisher_draws8} / "
         "{ood:heal_fisher_draws8@24576} for {cpu:fisher_draws8} CPU s of conversion against one draw's "
         "{cpu:fisher_seed1} at seed 1 on the same machine."),
        ("2026-12-04",
         "The token mask (`fisher_mask=token`) squares each position's mask gradient and sums the squares (a mask a "
         "neuron and position). At seeds 0 / 1 / 2: {ood:fisher_token} / {ood:fisher_token_seed1} / "
         "{ood:fisher_token_seed2} converted, {ood:heal_fisher_token@24576} / {ood:heal_fisher_token_seed1@24576} / "
         "{ood:heal_fisher_token_seed2@24576} healed: lower than the sequence score at every seed, for about the "
         "same CPU ({cpu:fisher_token} / {cpu:fisher_token_seed1} / {cpu:fisher_token_seed2} s against "
         "{cpu:fisher} / {cpu:fisher_seed1} / {cpu:fisher_seed2}). Its expectation leaves out the cross-position "
         "terms (a neuron removed is removed at every position at once) and it ranks better anyway; our reading, not "
         "tested apart: one square a sequence estimates those terms too noisily. It became the default."),
        ("2026-12-04",
         "Two draws of the token score at seed 0: {ood:fisher_token_draws2} converted and "
         "{ood:heal_fisher_token_draws2@24576} healed against one draw's {ood:fisher_token} / "
         "{ood:heal_fisher_token@24576}, for {cpu:fisher_token_draws2} CPU s against {cpu:fisher_token}: no gain, so "
         "the default stays one draw."),
        ("2026-12-04",
         "The heal keeps the token score's lead: {ood:heal_fisher_token@49152} / {ood:heal_fisher_token@98304} / "
         "{ood:heal_fisher_token@196608} / {ood:heal_fisher_token@393216} after 49,152 / 98,304 / 196,608 / 393,216 "
         "tokens against the sequence score's {ood:heal_fisher@49152} / {ood:heal_fisher@98304} / "
         "{ood:heal_fisher@196608} / {ood:heal_fisher@393216}. Both are flat past 200k tokens: from 196,608 to "
         "393,216 the calibration-domain set improves ({set:heal_fisher_token@196608:default-eval} to "
         "{set:heal_fisher_token@393216:default-eval}) and fiction loses "
         "({set:heal_fisher_token@196608:eval-fiction} to {set:heal_fisher_token@393216:eval-fiction}): the heal "
         "text's domains win."),
        ("2026-12-04",
         "On Gemma 3 270M (one seed) the two scores are level: {ood:gemma_fisher_token} against {ood:gemma_fisher} "
         "converted, {ood:heal_gemma_fisher_token@24576} against {ood:heal_gemma_fisher@24576} after 24,576 heal "
         "tokens (its calibration cache drawn anew with the same seed, not checked block for block against the "
         "earlier row's)."),
    ],
    "grow-init": [
        ("2026-12-03",
         "Growing layers keep every neuron and add new ones: `noise` (the default: small random output columns), "
         "`zero` (zero output columns, exactly function-preserving) or `split` (Net2Net: copies of the top-ranked "
         "neurons, the output column halved between the twins; function-preserving too). Zero against noise measured "
         "even on both sources, right after conversion and after a heal (fisher_zero.json, gemma_fisher_zero.json, "
         "grow_zero.json and their heals: git history). The grown neurons stay nearly dormant through a heal (the "
         "last table); a rate of their own (`optim.grown_lr_scale` 10) moved them more and healed worse on both "
         "sources (heal_grown_lr10.json, heal_gemma_relative_grown_lr10.json: git history)."),
        ("2026-12-04",
         "Split against noise under Fisher ranking, Gemma 3 270M: {ood:gemma_fisher_split} against "
         "{ood:gemma_fisher} right after conversion, {ood:heal_gemma_fisher_split@24576} against "
         "{ood:heal_gemma_fisher@24576} after 24,576 heal tokens; on SmolLM2-135M a gain as small after the heal, "
         "shrinking with tokens (fisher_split.json, heal_fisher_split.json: git history). Split makes the Fisher "
         "backward run through every layer (it ranks the growing layers to copy their top neurons): "
         "{cpu:gemma_fisher_split} CPU s of conversion against {cpu:gemma_fisher}. Noise stays the default."),
    ],
    "heal-recipe": [
        ("2026-12-03",
         "The heal's rate is relative to the weights (`optim.lr_relative`): 5.2e-4 times the RMS of the trained "
         "matrices, {lr:heal_fisher_token@24576} on SmolLM2-135M's default conversion and "
         "{lr:heal_gemma_fisher_token@24576} on Gemma 3 270M's, whose matrices are much smaller; an absolute 1e-4 "
         "made Gemma worse than unhealed (git history). Gemma's OBS conversion at the relative rate: "
         "{ood:heal_gemma_relative@0} to {ood:heal_gemma_relative@24576} in 24,576 tokens. Two changes that heal "
         "faster at first lose later: the source's own samples as the whole heal text, and steps of one block "
         "instead of four (heal_fisher_self.json, heal_fisher_selfbig.json, heal_fisher_b1.json: git history)."),
        ("2026-12-04",
         "Neither the rate's schedule nor a richer loss moves the long heal (the default conversion, 196,608 tokens "
         "in one run each): the constant rate {ood:heal_fisher_token@196608}; decaying linearly to 0 from the rate "
         "{ood:heal_fisher_token_linear@196608}, from twice it {ood:heal_fisher_token_linear2x@196608}, from four "
         "times it {ood:heal_fisher_token_linear4x@196608}; the constant rate with the residual streams' error added "
         "(`distill.hidden_weight 1`) {ood:heal_fisher_token_hidden1@196608}. At CPU scale the heal's plateau is not "
         "its rate's."),
        ("2026-12-04",
         "Nor is it the heal text's breadth as the source's own samples give it: 196,608 tokens on 416 fresh samples "
         "alone (`python bench/self_samples.py 416 --seed 1000 --out FILE`, no bundled mix) healed the default "
         "conversion to {ood:heal_fisher_token_selfonly@196608} against {ood:heal_fisher_token@196608} (fiction "
         "{set:heal_fisher_token_selfonly@196608:eval-fiction} against {set:heal_fisher_token@196608:eval-fiction}, "
         "legal {set:heal_fisher_token_selfonly@196608:eval-legal} against {set:heal_fisher_token@196608:eval-legal}: "
         "the mix holds no legal text, but its manuals' formal prose heals the legal set better than the samples do, "
         "our reading)."),
    ],
    "gradual-taper": [
        ("2026-12-04",
         "`--set taper_stages=K` (with `--heal-tokens N`) reaches the widths in K conversions: the `--ratio` multipliers "
         "move from 1 in K equal steps, each stage ranks the neurons of the current, partly healed model and heals "
         "N/K tokens from the source. At equal tokens (24,576, OBS ranking) it measured worse than one shot on both "
         "sources: SmolLM2-135M {ood:heal_gradual3@24576} against {ood:heal_obs@24576}, Gemma 3 270M "
         "{ood:heal_gemma_gradual3@24576} against {ood:heal_gemma_relative@24576}: each stage's heal is too short to "
         "recover its damage before the next. It is not the default."),
    ],
    "heal-step": [
        ("2026-12-02",
         "The chunked distillation loss takes the KL a chunk of positions at a time from the final hidden states and "
         "the head, so the [batch, sequence, vocabulary] logits are never formed. The sweep over the chunk on "
         "SmolLM2-135M's and Gemma 3 270M's heads (the second file) chose the default chunk "
         "(`HEAD_CHUNK` in tlm_train/losses.py)."),
        ("2026-12-03",
         "One heal step side by side: no teacher (plain), the whole-logit KL, the chunked KL (the heal's) and the "
         "teacher's cached top k (the first file)."),
    ],
    "fold": [
        ("2026-12-06",
         "The rule, stated before the runs: the fold becomes the default if it beats the default (Fisher drop and "
         "refit) on both families by more than the seed spread, right after conversion and after a 24,576-token "
         "heal; else it stays a method knob with this page, or is removed. The fold (tlm_convert/fold.py): "
         "scikit-learn's k-means on each neuron's gate and up rows in the metric of their pre-activations on the "
         "calibration tokens, weighted by the Fisher scores and started from the neurons the drop keeps (10 Lloyd "
         "iterations at most); a cluster's rows are its members' weighted mean, its down column their sum, and the "
         "residual refit then fits the down projection on the folded neurons' own activations."),
        ("2026-12-06",
         "SmolLM2-135M, the default's calibration blocks, conversion seeds 0 / 1 / 2 (growth noise and Fisher "
         "targets; the same seeds as the default's rows): folded {ood:fold_seed0} / {ood:fold_seed1} / "
         "{ood:fold_seed2} right after conversion (geometric mean {gmean:fold_seed0,fold_seed1,fold_seed2}) against "
         "the drop's {ood:fisher_token} / {ood:fisher_token_seed1} / {ood:fisher_token_seed2} "
         "({gmean:fisher_token,fisher_token_seed1,fisher_token_seed2}); after 24,576 heal tokens "
         "{gmean:heal_fold_seed0,heal_fold_seed1,heal_fold_seed2@24576} against "
         "{gmean:heal_fisher_token,heal_fisher_token_seed1,heal_fisher_token_seed2@24576}. Every set is worse at "
         "every seed, by far more than the seeds' spread, and the heal does not close the gap. The conversion's CPU "
         "is no more than the drop's ({cpu:fold_seed0} / {cpu:fold_seed1} / {cpu:fold_seed2} s against "
         "{cpu:fisher_token} / {cpu:fisher_token_seed1} / {cpu:fisher_token_seed2} s, each beside another job): the "
         "clustering's cost is lost in the shared machines' spread. Gemma 3 270M (seed 0; its calibration blocks "
         "drawn anew with the default's seed, that cache not kept): folded {ood:gemma_fold} right after conversion "
         "against the drop's {ood:gemma_fisher_token}, and {ood:heal_gemma_fold@24576} against "
         "{ood:heal_gemma_fisher_token@24576} after 24,576 heal tokens, again worse on every set."),
        ("2026-12-06",
         "Reading by the rule: the fold loses on both families, so the drop stays the default and the fold stays a "
         "method knob (`--set shrink=fold`) with this page. What a single MLP showed before the runs (not kept as a "
         "file): the merged neurons' error on held-out tokens was above the drop's at every layer tried, and the "
         "closer a merge stayed to its seed neuron the better, the drop being that limit; the refit already "
         "recovers most of what the dropped neurons carried, and merging perturbs the neurons it keeps."),
    ],
    "compare": [
        ("2026-12-03",
         "`tlm compare` at CPU scale, 5 seeds each (`recipes/compare/*.yaml`). Attention (N = 90 steps): the "
         "converted model ends below the same checkpoint continued as it is "
         "({pair:compare:cpu-attention/90+90/converted-cpt} at M = 90, "
         "{pair:compare:cpu-attention/90+270/converted-cpt} at M = 270; with `--schedule measured-taper` "
         "{pair:compare:cpu-measured/90+270/converted-cpt}) and below the uninterrupted uniform run; it does not "
         "catch the model tapered from scratch. Titans: the conversion is within the noise "
         "({pair:compare:cpu-titans/60+180/converted-cpt}) although the taper from scratch helps it "
         "({pair:compare:cpu-titans/60+180/tapered-scratch}). From scratch, cosine and x-shape tie ahead of uniform "
         "and middle-heavy is behind it (the cpu-shapes rows)."),
        ("2026-12-05",
         "Re-run with the token-mask Fisher ranking on another machine (AMD EPYC), arms (c) and (d) at three ratios "
         "(`recipes/compare/cpu-ratio150.yaml`, `cpu-ratio140.yaml`, `cpu-ratio125.yaml`): converted minus continued "
         "is within the noise at every ratio, every mean below zero, the smallest at 1.25/0.75 (the cpu-ratio rows). "
         "The earlier win does not repeat at 1.5/0.5 here, and not because of the ranking: with that day's OBS "
         "ranking on this machine (`tlm compare recipes/compare/cpu-ratio150.yaml --set convert.importance=obs`, one "
         "run, no result file) it stays within the noise. The machine's arithmetic moves the runs (the "
         "uniform-continued arm, the same recipe and seeds, differs between the two machines) and with them a seed "
         "or two's sign: at this size the conversion's lead over continuing is a few thousandths of a nat, inside "
         "the seed spread."),
        ("2026-12-05",
         "Five more seeds of cpu-ratio150 and cpu-ratio140 (`--seeds 5-9`; no result file, the runs were not kept) "
         "made ten. As recorded that day, without a file to regenerate them from: both ratios lead by about 0.005 "
         "nats/token at M = 90 (8/10 seeds lower, a one-sample t-test over the paired differences p = 0.006 each, "
         "while the rule still reads within the noise) and by nothing a t-test tells from zero at M = 270."),
    ],
    "evidence": [
        ("2026-12-01",
         "From scratch, 3 seeds, equal parameter counts: cosine 1.5/0.5 against uniform and the reversed taper for "
         "five mixers (eval loss in nats/byte). On average cosine ends below uniform for every mixer and the "
         "reversed taper above it (the paired differences); with 3 seeds most pairs are within their spread. The "
         "converted-against-continued records of an earlier version (a two-phase schedule) stay in evidence.jsonl; "
         "the compare study supersedes them."),
    ],
}
