//! The report of `plugin test` as a table: one row per case, with the rule and path of
//! each refusal, then the rules page's section of each broken rule, then the counts. Columns are as wide as their widest cell; the reason
//! comes last, whole, so nothing a plugin author needs is cut.

use super::runner::{Report, Verdict};

const HEADER: [&str; 4] = ["CASE", "RESULT", "RULE", "PATH"];

/// The table, ending with a summary line.
pub fn render(report: &Report) -> String {
    let rows: Vec<[String; 5]> = report
        .outcomes
        .iter()
        .map(|o| match &o.verdict {
            Verdict::Pass => [
                o.case.label(),
                "pass".into(),
                "-".into(),
                "-".into(),
                String::new(),
            ],
            Verdict::Fail {
                rule, path, detail, ..
            } => [
                o.case.label(),
                "FAIL".into(),
                rule.clone(),
                path.clone().unwrap_or_else(|| "-".into()),
                detail.clone(),
            ],
        })
        .collect();
    let mut widths = HEADER.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row.iter()) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; 5]| {
        let mut s = String::new();
        for (i, cell) in cells.iter().take(4).enumerate() {
            s.push_str(cell);
            if i < 3 || !cells[4].is_empty() {
                let pad = widths[i].saturating_sub(cell.chars().count()) + 2;
                s.push_str(&" ".repeat(pad));
            }
        }
        s.push_str(cells[4]);
        s.truncate(s.trim_end().len());
        s.push('\n');
        s
    };
    let mut out = format!(
        "{} plugin {} (sha256 {})\n",
        report.kind.as_str(),
        report.plugin,
        report.sha256
    );
    for note in &report.notes {
        out.push_str(&format!("note: {note}\n"));
    }
    for warning in &report.warnings {
        out.push_str(&format!("warning: {warning}\n"));
    }
    out.push_str(&line([
        HEADER[0], HEADER[1], HEADER[2], HEADER[3], "REASON",
    ]));
    for row in &rows {
        out.push_str(&line([&row[0], &row[1], &row[2], &row[3], &row[4]]));
    }
    // Each broken rule's section of the rules page, once.
    let mut seen: Vec<&str> = Vec::new();
    for o in &report.outcomes {
        if let Verdict::Fail { see: Some(see), .. } = &o.verdict
            && !seen.contains(&see.as_str())
        {
            seen.push(see);
            out.push_str(&format!("see {see}\n"));
        }
    }
    let failed = rows.iter().filter(|r| r[1] == "FAIL").count();
    out.push_str(&format!(
        "{} case(s): {} passed, {failed} failed\n",
        rows.len(),
        rows.len() - failed
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authoring::matrix::{Addressing, Case};
    use crate::authoring::runner::Outcome;
    use crate::config::Firmware;
    use crate::templates::TemplateKind;

    fn case(firmware: Firmware, addressing: Addressing) -> Case {
        Case {
            host: "kvm-a".into(),
            machine_type: "small".into(),
            firmware,
            nics: Some(1),
            rendered_nics: None,
            addressing: Some(addressing),
            settings: Vec::new(),
        }
    }

    #[test]
    fn rows_align_and_failures_carry_rule_path_and_reason() {
        let report = Report {
            kind: TemplateKind::Domain,
            plugin: "domain:/p.wasm".into(),
            sha256: "ab".repeat(32),
            notes: vec!["only one-NIC cases".into()],
            warnings: vec!["no guest agent channel".into()],
            outcomes: vec![
                Outcome {
                    case: case(Firmware::Bios, Addressing::Dhcp),
                    verdict: Verdict::Pass,
                },
                Outcome {
                    case: case(Firmware::Efi, Addressing::Static([10, 0, 0, 5].into())),
                    verdict: Verdict::Fail {
                        rule: "firmware-matches".into(),
                        path: Some("/domain/os".into()),
                        detail: "the machine type asks for UEFI".into(),
                        see: Some("rules.md#firmware-matches".into()),
                    },
                },
            ],
        };
        let table = render(&report);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines[0],
            format!("domain plugin domain:/p.wasm (sha256 {})", "ab".repeat(32))
        );
        assert_eq!(lines[1], "note: only one-NIC cases");
        assert_eq!(lines[2], "warning: no guest agent channel");
        assert_eq!(
            &lines[3..],
            [
                "CASE                     RESULT  RULE              PATH        REASON",
                "kvm-a bios 1-nic dhcp    pass    -                 -",
                "kvm-a uefi 1-nic static  FAIL    firmware-matches  /domain/os  the machine type asks for UEFI",
                "see rules.md#firmware-matches",
                "2 case(s): 1 passed, 1 failed",
            ]
        );
        assert!(!report.passed());
    }
}
