//! The rule-based transcript cleaner the `fallback` policy answers with when the local LLM cannot
//! keep up: whitespace, filler words, stuttered repeats, sentence capitals, "i" → "I" and final
//! punctuation. Deterministic and cheap; it never invents words.

/// Filler words removed wherever they stand alone.
const FILLERS: &[&str] = &[
    "um", "umm", "uh", "uhh", "uhm", "er", "erm", "ah", "hmm", "hm", "mm", "mhm",
];

fn is_terminator(c: char) -> bool {
    matches!(c, '.' | '!' | '?' | '…')
}

/// Splits a token into its word core and trailing punctuation.
fn split_trailing(token: &str) -> (&str, &str) {
    let end = token
        .char_indices()
        .rev()
        .take_while(|(_, c)| c.is_ascii_punctuation() && *c != '\'' || *c == '…')
        .last()
        .map(|(i, _)| i)
        .unwrap_or(token.len());
    token.split_at(end)
}

fn normalise(word: &str) -> String {
    word.trim_matches(|c: char| !c.is_alphanumeric() && c != '\'')
        .to_lowercase()
}

/// Cleans one transcript. Empty or whitespace-only input gives an empty string.
pub fn clean_transcript(text: &str) -> String {
    let mut kept: Vec<String> = Vec::new();
    for token in text.split_whitespace() {
        let (core, trailing) = split_trailing(token);
        let word = normalise(core);
        if FILLERS.contains(&word.as_str()) {
            // Keep a sentence end the filler carried ("so um." -> "so.").
            if let Some(last) = kept.last_mut()
                && trailing.chars().any(is_terminator)
                && !last.ends_with(is_terminator)
            {
                last.push_str(trailing.trim_start_matches(','));
            }
            continue;
        }
        if word.is_empty() && core.is_empty() {
            // Bare punctuation: glue it to the previous word.
            if let Some(last) = kept.last_mut() {
                if !last.ends_with(|c: char| c.is_ascii_punctuation()) {
                    last.push_str(trailing);
                }
                continue;
            }
            continue;
        }
        if let Some(last) = kept.last_mut() {
            let (last_core, last_trailing) = split_trailing(last);
            if last_trailing.is_empty() && !word.is_empty() && normalise(last_core) == word {
                // "the the" -> "the"; "it it." -> "it."
                *last = format!("{last_core}{trailing}");
                continue;
            }
        }
        let fixed = match word.as_str() {
            "i" | "i'm" | "i've" | "i'll" | "i'd" => {
                let mut chars = core.chars();
                chars.next();
                format!("I{}{}", chars.as_str(), trailing)
            }
            _ => token.to_string(),
        };
        kept.push(fixed);
    }
    let mut sentence_start = true;
    for word in &mut kept {
        if sentence_start {
            *word = capitalise(word);
        }
        sentence_start = word.ends_with(is_terminator);
    }
    let mut out = kept.join(" ");
    // A trailing comma or similar becomes the sentence end.
    while out.ends_with([',', ';', ':', '-']) {
        out.pop();
    }
    if !out.is_empty() && !out.ends_with(is_terminator) {
        out.push('.');
    }
    out
}

fn capitalise(word: &str) -> String {
    let mut done = false;
    word.chars()
        .map(|c| {
            if !done && c.is_alphabetic() {
                done = true;
                c.to_uppercase().next().unwrap_or(c)
            } else {
                c
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::clean_transcript;

    #[test]
    fn cleans_the_documented_cases() {
        let cases = [
            ("", ""),
            ("   \n\t ", ""),
            ("hello   world", "Hello world."),
            ("um so i think uh we should go", "So I think we should go."),
            ("the the cat sat on on the mat", "The cat sat on the mat."),
            ("i'm here. i've been there", "I'm here. I've been there."),
            ("is it ready? yes it is!", "Is it ready? Yes it is!"),
            ("well, um, that's it,", "Well, that's it."),
            ("we went home um.", "We went home."),
            ("Already clean.", "Already clean."),
            ("  leading and trailing  ", "Leading and trailing."),
            ("it it. fine", "It. Fine."),
            ("Hmm i guess", "I guess."),
            ("élan vital", "Élan vital."),
        ];
        for (input, want) in cases {
            assert_eq!(clean_transcript(input), want, "input {input:?}");
        }
    }

    #[test]
    fn keeps_words_that_only_look_like_fillers() {
        assert_eq!(
            clean_transcript("umbrella under hummus"),
            "Umbrella under hummus."
        );
        assert_eq!(clean_transcript("that that's fine"), "That that's fine.");
    }

    #[test]
    fn never_panics_on_odd_input() {
        for input in ["...", "!!!", "'", "i", "…", "a , , b", "\u{0}", "ü ü ü"] {
            let _ = clean_transcript(input);
        }
        assert_eq!(clean_transcript("i"), "I.");
        assert_eq!(clean_transcript("ü ü ü"), "Ü.");
    }
}
